"""What `dtype auto` asks of the CPU (config/engine.py `EngineConfig.torch_dtype`): whether it
multiplies bfloat16 natively, whether that outpaces float32, and whether the native kernels,
which read bfloat16 weights on every ISA level, may run."""

from __future__ import annotations

import os
from pathlib import Path


def native_kernels_enabled() -> bool:
    """Whether the native CPU kernels may run (`TOKENMILL_NATIVE_KERNELS`; read here, below
    kernels/native.py, which asks the same). Their products read bfloat16 weights on every
    ISA level, so a bandwidth-bound decoder keeps a bfloat16 checkpoint's bytes even without
    native bf16 arithmetic: on an AVX2 Zen 3, Gemma-3-1B-shaped batch-1 decode ran 11.8 steps/s
    in bfloat16 against 5.8 in float32, the same 21.5 tok/s at 16 requests
    (docs/benchmarks.md, "Gemma 3 and Phi-4-mini on AVX2")."""
    return os.environ.get("TOKENMILL_NATIVE_KERNELS", "1") != "0"


def cpu_has_fast_half_matmul() -> bool:
    """AVX512_BF16 or AMX tiles (torch's own checks; torch._C._cpu lost them in torch 2.13,
    which made this silently False)."""
    import torch

    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def cpu_bf16_outpaces_f32() -> bool:
    """Whether bfloat16 products run faster than float32 ones (not only read fewer bytes):
    with AMX tiles, or on AMD's AVX512_BF16 (Zen 4/5 issue VDPBF16PS at twice the float32 FMA
    rate). Intel's AVX512_BF16 without AMX issues it at the FMA rate and pays conversions on
    top: bge-small's encoder ran 21.6 texts/s in bfloat16 against 27.2 in float32 on an
    Emerald Rapids VM without AMX (docs/benchmarks.md, "Embeddings")."""
    import torch

    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return True
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "AuthenticAMD" in cpuinfo
