"""Building, caching and loading the C++ CPU kernels (`csrc/*.cpp`, one module).

The extension is compiled at first use (gcc and ninja) into a directory under the user's cache
keyed by everything the build depends on; a valid build there is loaded without the compiler,
by any process, checkout or environment with the same key (`extension_cache.py`). Building
takes ~60 s of CPU (seven files, compiled in parallel), once per key; it prints one progress
line.

Where it cannot be built (no compiler, no ninja, an unsupported CPU) every caller falls back to
the portable torch code, with one warning. Environment:

- `TOKENMILL_NATIVE_KERNELS=0`: never build or use the extension (the portable path).
- `TOKENMILL_CPU_ISA=portable|avx2|avx512|avx512_bf16|amx`: run a lower instruction set than
  the CPU's best (tests run the AVX2 path on an AVX-512 machine this way); never a higher one.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from tokenmill.config.cpu_dtype import native_kernels_enabled
from tokenmill.kernels.extension_cache import ExtensionSpec, load_extension

ISA_LEVELS = ("portable", "avx2", "avx512", "avx512_bf16", "amx")
_SOURCE_DIR = Path(__file__).parent / "csrc"
_state: dict[str, ModuleType | None] = {}


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tokenmill" / "torch_extensions"


_KERNELS = ExtensionSpec(
    prefix="tokenmill_cpu_kernels",
    source_dir=_SOURCE_DIR,
    # No FP traps: lets GCC if-convert clamps (min/max) so AVX2 loops around them vectorize.
    cflags=("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"),
    ldflags=("-fopenmp",),
    label="the CPU kernels (~60 s of CPU)",
)


def _build() -> ModuleType:
    return load_extension(_KERNELS, cache_root())


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
    if native_kernels_enabled():
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
