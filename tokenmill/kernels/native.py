"""Building, caching and loading the C++ CPU kernels (`csrc/*.cpp`, one module).

The extension is compiled at first use with `torch.utils.cpp_extension.load` (gcc and ninja),
into a directory under the user's cache keyed by the source's hash, torch's version and the
compiler flags: a restart, or another process, reuses it. One process builds at a time, under
an `flock` that the kernel releases if the builder dies; torch's own lock file, which a killed
builder leaves behind (and torch then waits on forever), is cleared under it. Building takes
~60 s of CPU (seven files, compiled in parallel), once per machine and source version; it is
logged.

Where it cannot be built (no compiler, no ninja, an unsupported CPU) every caller falls back to
the portable torch code, with one warning. Environment:

- `TOKENMILL_NATIVE_KERNELS=0`: never build or use the extension (the portable path).
- `TOKENMILL_CPU_ISA=portable|avx2|avx512|avx512_bf16|amx`: run a lower instruction set than
  the CPU's best (tests run the AVX2 path on an AVX-512 machine this way); never a higher one.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

ISA_LEVELS = ("portable", "avx2", "avx512", "avx512_bf16", "amx")
_SOURCE_DIR = Path(__file__).parent / "csrc"
_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]
_state: dict[str, ModuleType | None] = {}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenmill" / "torch_extensions"


def _sources() -> list[Path]:
    return sorted(_SOURCE_DIR.glob("*.cpp"))


def _build_name() -> str:
    digest = hashlib.sha256()
    for path in sorted(_SOURCE_DIR.glob("*.[ch]*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(f"{torch.__version__}|{' '.join(_CFLAGS)}".encode())
    return f"tokenmill_cpu_kernels_{digest.hexdigest()[:12]}"


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    name = _build_name()
    build_dir = cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    built = any(build_dir.glob(f"{name}*.so"))
    if not built:
        logger.warning(
            "building tokenmill's CPU kernels once (~60 s of CPU over the machine's cores: "
            "~35 s on 2 idle cores; cached in %s)",
            build_dir,
        )
    start = time.perf_counter()
    with open(build_dir / "tokenmill-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        (build_dir / "lock").unlink(missing_ok=True)  # torch's baton, stale if we hold ours
        module = load(
            name=name,
            sources=[str(path) for path in _sources()],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    if not built:
        logger.warning("built tokenmill's CPU kernels in %.0f s", time.perf_counter() - start)
    return module


def requested_isa() -> int | None:
    """The level TOKENMILL_CPU_ISA asks for, or None (the CPU's best)."""
    name = os.environ.get("TOKENMILL_CPU_ISA", "").strip().lower()
    if not name:
        return None
    if name not in ISA_LEVELS:
        raise ValueError(f"TOKENMILL_CPU_ISA={name!r}: one of {', '.join(ISA_LEVELS)}")
    return ISA_LEVELS.index(name)


def native_kernels() -> ModuleType | None:
    """The loaded extension with its ISA level set, or None where it is off or unbuildable
    (warned once)."""
    if "module" in _state:
        return _state["module"]
    module = None
    if os.environ.get("TOKENMILL_NATIVE_KERNELS", "1") != "0":
        try:
            module = _build()
        except Exception as error:  # no compiler, no ninja, a failed build: run portable
            warnings.warn(
                f"tokenmill's CPU kernels could not be built ({type(error).__name__}: "
                f"{str(error).strip().splitlines()[-1] if str(error).strip() else ''}); "
                "using the portable torch path",
                RuntimeWarning,
                stacklevel=2,
            )
    if module is not None:
        level = requested_isa()
        module.set_isa(module.detect_isa() if level is None else level)
    _state["module"] = module
    return module


def active_isa() -> str | None:
    """The instruction set the kernels run (None: the portable torch path)."""
    module = native_kernels()
    return None if module is None else ISA_LEVELS[module.get_isa()]


@contextmanager
def using_isa(level: int) -> Iterator[int]:
    """Run the kernels at `level` (at most the CPU's best) inside the block, as
    TOKENMILL_CPU_ISA does for a process: tests run every path on one machine."""
    module = native_kernels()
    assert module is not None, "no native kernels here"
    before = module.get_isa()
    try:
        yield module.set_isa(level)
    finally:
        module.set_isa(before)


def reset_for_tests() -> None:
    """Forget the loaded state, so that the environment is read again."""
    _state.clear()
