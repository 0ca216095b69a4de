"""The C++ extension cache: keyed by what a build depends on, a finished build imported without
the compiler (from any checkout or environment with the same key), one progress line when a
build runs, and no hang on a killed builder's lock. Builds a tiny C extension in a temporary
cache (well under a second of compiling), never the shared one."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tokenmill.kernels import extension_cache
from tokenmill.kernels.extension_cache import ExtensionSpec, build_inputs, load_extension

TINY_SOURCE = r"""
#include <Python.h>
#define STR2(x) #x
#define STR(x) STR2(x)
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {
    {"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {
    PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""

# Loads the tiny extension in a fresh process whose compiler entry point refuses to run.
LOAD_WITHOUT_COMPILER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import torch.utils.cpp_extension

    def refuse(*args, **kwargs):
        raise AssertionError("the compiler was called")

    torch.utils.cpp_extension.load = refuse
    from tokenmill.kernels.extension_cache import ExtensionSpec, load_extension

    spec = ExtensionSpec("tiny", Path(sys.argv[1]), ("-O0",), ())
    assert load_extension(spec, Path(sys.argv[2])).answer() == 42
    """
)


def _tiny_spec(directory: Path) -> ExtensionSpec:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiny.cpp").write_text(TINY_SOURCE)
    return ExtensionSpec("tiny", directory, ("-O0",), ())


def _load_without_compiler(spec: ExtensionSpec, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_COMPILER, str(spec.source_dir), str(cache)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_environments_that_build_differently_get_different_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _tiny_spec(tmp_path / "src")
    here = build_inputs(spec).name
    assert build_inputs(spec).name == here  # the same environment: the same key

    paths = dict(extension_cache.sysconfig.get_paths())
    paths["include"] = str(tmp_path / "other-python" / "include")
    with monkeypatch.context() as patch:
        patch.setattr(extension_cache.sysconfig, "get_paths", lambda: paths)
        assert build_inputs(spec).name != here  # another Python's headers
    with monkeypatch.context() as patch:
        patch.setattr(extension_cache.torch, "__version__", "0.0.0-other")
        assert build_inputs(spec).name != here
    fake_compiler = tmp_path / "bin" / "c++"
    fake_compiler.parent.mkdir()
    fake_compiler.write_text("#!/bin/sh\n")
    fake_compiler.chmod(0o755)
    with monkeypatch.context() as patch:
        patch.setenv("CXX", str(fake_compiler))
        assert build_inputs(spec).name != here
    assert ExtensionSpec("tiny", spec.source_dir, ("-O1",), ()) != spec
    assert build_inputs(ExtensionSpec("tiny", spec.source_dir, ("-O1",), ())).name != here
    (spec.source_dir / "tiny.h").write_text("// a header changes the build too\n")
    assert build_inputs(spec).name != here


def test_a_venv_over_the_same_python_shares_the_key(tmp_path: Path) -> None:
    """A venv with --system-site-packages compiles against the same headers with the same
    compiler: it shares the build instead of building its own."""
    spec = _tiny_spec(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    code = (
        "import sys; from pathlib import Path; "
        "from tokenmill.kernels.extension_cache import ExtensionSpec, build_inputs; "
        "print(build_inputs(ExtensionSpec('tiny', Path(sys.argv[1]), ('-O0',), ())).name)"
    )
    other = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code, str(spec.source_dir)],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.stdout.strip() == build_inputs(spec).name


def test_a_finished_build_is_loaded_without_the_compiler_from_any_checkout(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    spec = _tiny_spec(tmp_path / "checkout-a")
    progress = io.StringIO()
    assert load_extension(spec, cache, progress).answer() == 42
    assert "building a C++ extension" in progress.getvalue()

    again = _load_without_compiler(spec, cache)  # the same environment, a new process
    assert again.returncode == 0, again.stderr
    assert "building" not in again.stderr
    # A second checkout of the same sources (other paths in torch's build.ninja) shares it.
    second = _tiny_spec(tmp_path / "checkout-b")
    from_second = _load_without_compiler(second, cache)
    assert from_second.returncode == 0, from_second.stderr
    assert len(list(cache.iterdir())) == 1


def test_an_unfinished_build_is_built_again(tmp_path: Path) -> None:
    """A library without the marker (a builder killed while linking) is not trusted."""
    cache = tmp_path / "cache"
    spec = _tiny_spec(tmp_path / "src")
    load_extension(spec, cache, io.StringIO())
    build_dir = cache / build_inputs(spec).name
    (build_dir / extension_cache.MARKER).unlink()
    assert _load_without_compiler(spec, cache).returncode != 0  # it has to compile
    progress = io.StringIO()
    assert load_extension(spec, cache, progress).answer() == 42
    assert "done in" in progress.getvalue()
    recorded = json.loads((build_dir / extension_cache.MARKER).read_text())
    assert recorded == build_inputs(spec).as_json()


def test_a_failed_build_says_so_and_leaves_no_marker(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    spec = _tiny_spec(tmp_path / "src")
    (spec.source_dir / "tiny.cpp").write_text("this is not C++\n")
    progress = io.StringIO()
    with pytest.raises(RuntimeError):
        load_extension(spec, cache, progress)
    assert "failed in" in progress.getvalue()
    assert not (cache / build_inputs(spec).name / extension_cache.MARKER).exists()


def test_a_killed_builders_lock_file_does_not_hang_the_next_build(tmp_path: Path) -> None:
    """torch waits forever on its lock file while it exists; a builder killed mid-build leaves
    it behind. The next build clears it under tokenmill's own flock."""
    cache = tmp_path / "cache"
    spec = _tiny_spec(tmp_path / "src")
    build_dir = cache / build_inputs(spec).name
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()
    code = (
        "import io, sys; from pathlib import Path; "
        "from tokenmill.kernels.extension_cache import ExtensionSpec, load_extension; "
        "spec = ExtensionSpec('tiny', Path(sys.argv[1]), ('-O0',), ()); "
        "assert load_extension(spec, Path(sys.argv[2]), io.StringIO()).answer() == 42"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(spec.source_dir), str(cache)], check=True, timeout=120
    )
    assert not (build_dir / "lock").exists()
