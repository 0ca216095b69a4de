"""Built C++ extensions, cached under a key of everything the build depends on.

`torch.utils.cpp_extension.load` runs ninja on every call, and its `build.ninja` holds the
sources' paths and the environment's include paths: two checkouts or environments sharing one
build directory rewrote that file in turn and rebuilt everything (~55 s) at every start, with
no word said. Here the directory's name is a hash of the build's inputs (the sources' bytes,
torch's version and build, Python's version and ABI, the include directories, the compiler
binary, the flags). A directory that holds a finished build (its `build_inputs.json`, written
last) is imported directly, without ninja or the compiler; anything else builds once, under an
`flock` (released by the kernel if the builder dies), with one progress line on stderr.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import TextIO

import torch

MARKER = "build_inputs.json"


@dataclass(frozen=True)
class ExtensionSpec:
    """One extension: its name prefix, its sources (`*.cpp`, with headers beside them), flags,
    and what the progress line calls it."""

    prefix: str
    source_dir: Path
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    label: str = "a C++ extension"

    def sources(self) -> list[Path]:
        return sorted(self.source_dir.glob("*.cpp"))


@dataclass(frozen=True)
class BuildInputs:
    """What a build's output depends on; two processes with equal inputs can share a build."""

    prefix: str
    sources: tuple[tuple[str, str], ...]  # (file name, sha256) of every source and header
    torch: str
    python: str
    include_paths: tuple[str, ...]
    compiler: str
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]

    def as_json(self) -> dict:
        return json.loads(json.dumps(asdict(self)))  # tuples as lists, as read back

    @property
    def key(self) -> str:
        text = json.dumps(self.as_json(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def name(self) -> str:
        """The build directory's and the module's name."""
        return f"{self.prefix}_{self.key}"


def include_paths() -> tuple[str, ...]:
    """The include directories torch's build passes (torch's headers, then Python's)."""
    torch_include = Path(torch.__file__).parent / "include"
    return (
        str(torch_include),
        str(torch_include / "torch" / "csrc" / "api" / "include"),
        sysconfig.get_paths()["include"],
    )


def compiler_identity() -> str:
    """The C++ compiler torch would run (`$CXX`, else `c++`), as its resolved binary with size
    and modification time: an upgraded compiler is another key, and nothing is executed."""
    command = os.environ.get("CXX", "c++")
    found = shutil.which(command)
    if found is None:
        return f"{command} (not found)"
    binary = Path(found).resolve()
    stat = binary.stat()
    return f"{command} -> {binary} ({stat.st_size} bytes, mtime {stat.st_mtime_ns})"


def build_inputs(spec: ExtensionSpec) -> BuildInputs:
    sources = tuple(
        (path.name, hashlib.sha256(path.read_bytes()).hexdigest())
        for path in sorted(spec.source_dir.glob("*.[ch]*"))
    )
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return BuildInputs(
        prefix=spec.prefix,
        sources=sources,
        torch=f"{torch.__version__} git {torch.version.git_version} cxx11abi {abi}",
        python=f"{sys.version} {sysconfig.get_config_var('SOABI')}",
        include_paths=include_paths(),
        compiler=compiler_identity(),
        cflags=spec.cflags,
        ldflags=spec.ldflags,
    )


def load_extension(
    spec: ExtensionSpec, cache_root: Path, stream: TextIO | None = None
) -> ModuleType:
    """The extension's module: a finished build for these inputs imported as it is, else built
    once (other processes wait on the lock, then import what it built)."""
    inputs = build_inputs(spec)
    build_dir = cache_root / inputs.name
    module = load_built(inputs, build_dir)
    if module is not None:
        return module
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "tokenmill-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        module = load_built(inputs, build_dir)  # built by another process while we waited
        if module is None:
            module = _compile(spec, inputs, build_dir, stream or sys.stderr)
    return module


def load_built(inputs: BuildInputs, build_dir: Path) -> ModuleType | None:
    """The finished build in `build_dir`, imported without ninja or the compiler; None when
    there is none (no marker, or one for other inputs, or no library)."""
    library = build_dir / f"{inputs.name}.so"
    try:
        recorded = json.loads((build_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if recorded != inputs.as_json() or not library.is_file():
        return None
    module_spec = importlib.util.spec_from_file_location(inputs.name, library)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _compile(
    spec: ExtensionSpec, inputs: BuildInputs, build_dir: Path, stream: TextIO
) -> ModuleType:
    from torch.utils.cpp_extension import load

    (build_dir / "lock").unlink(missing_ok=True)  # torch's baton, stale if we hold ours
    sources = spec.sources()
    with BuildProgress(stream, spec.label, build_dir, len(sources)):
        module = load(
            name=inputs.name,
            sources=[str(path) for path in sources],
            extra_cflags=list(spec.cflags),
            extra_ldflags=list(spec.ldflags),
            build_directory=str(build_dir),
            verbose=False,
        )
    marker = build_dir / f"{MARKER}.tmp"
    marker.write_text(json.dumps(inputs.as_json(), indent=1))
    marker.replace(build_dir / MARKER)  # written last: the build is complete
    return module


class BuildProgress:
    """One line on `stream` while a build runs: files compiled and seconds taken, rewritten in
    place on a terminal; elsewhere (a log) the line is written once, then its end."""

    def __init__(self, stream: TextIO, label: str, build_dir: Path, num_files: int) -> None:
        self.stream = stream
        self.build_dir = build_dir
        self.num_files = num_files
        self.interactive = stream.isatty()
        self.started = time.time()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._tick, name="build-progress", daemon=True)
        self.head = (
            f"tokenmill: building {label} for this environment, once (cached in {build_dir})"
        )

    def compiled(self) -> int:
        return sum(1 for path in self.build_dir.glob("*.o") if path.stat().st_mtime >= self.started)

    def _line(self) -> str:
        elapsed = time.time() - self.started
        return f"{self.head}: {self.compiled()}/{self.num_files} files, {elapsed:.0f} s"

    def _tick(self) -> None:
        while not self.done.wait(1.0):
            self.stream.write(f"\r{self._line()}")
            self.stream.flush()

    def __enter__(self) -> BuildProgress:
        if self.interactive:
            self.stream.write(self._line())
            self.thread.start()
        else:
            self.stream.write(f"{self.head} ...\n")
        self.stream.flush()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.done.set()
        if self.interactive:
            self.thread.join()
        elapsed = time.time() - self.started
        outcome = "failed" if exc_info[0] is not None else "done"
        prefix = f"\r{self._line()}, " if self.interactive else f"{self.head}: "
        self.stream.write(f"{prefix}{outcome} in {elapsed:.0f} s\n")
        self.stream.flush()
