"""The choice of an attention backend, made once at start-up.

Every backend is a `PagedAttention` (base.py): the same inputs (a step's flat queries, its new
keys and values, one layer's paged cache and the step's `AttentionMetadata`), `[num_tokens,
heads, head_dim]` out. `torch` (`TorchPagedAttention`, torch_backend.py) runs anywhere and is
the reference; `cpu` (`CpuPagedAttention`, cpu_backend.py) runs a whole step (decodes, drafts
and prefill chunks) in one call of the native CPU kernel (kernels/attention.py), FP8 caches as
`torch`; `triton` (`TritonPagedAttention`, triton_backend.py) reads K/V through the block tables
inside one kernel, for CUDA.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from tokenmill.config import ATTENTION_BACKENDS, ConfigError
from tokenmill.layers.attention.base import PagedAttention
from tokenmill.layers.attention.torch_backend import TorchPagedAttention


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_attention_backend(requested: str, device: torch.device) -> str:
    """`auto` is `triton` on CUDA when Triton is installed, else `torch`. An explicit
    `triton` without CUDA is allowed only under `TRITON_INTERPRET=1` (tests)."""
    if requested not in ATTENTION_BACKENDS:
        raise ConfigError(f"unknown attention backend {requested!r}; one of {ATTENTION_BACKENDS}")
    if requested == "auto":
        if device.type == "cuda":
            return "triton" if triton_available() else "torch"
        return "cpu" if device.type == "cpu" else "torch"
    if requested == "cpu" and device.type != "cpu":
        raise ConfigError("attention backend 'cpu' runs on the CPU")
    if requested == "triton" and not triton_available():
        raise ConfigError("attention backend 'triton' needs the triton package")
    if requested == "triton" and device.type != "cuda" and not os.environ.get("TRITON_INTERPRET"):
        raise ConfigError("attention backend 'triton' runs on CUDA (elsewhere only interpreted)")
    return requested


def make_attention_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
) -> PagedAttention:
    """One attention layer's backend of kind `name` (resolved), made when the model is built."""
    if name == "triton":
        from tokenmill.layers.attention.triton_backend import TritonPagedAttention

        return TritonPagedAttention(num_heads, num_kv_heads, head_dim, scale)
    if name == "cpu":
        from tokenmill.layers.attention.cpu_backend import CpuPagedAttention

        return CpuPagedAttention(num_heads, num_kv_heads, head_dim, scale)
    if name == "torch":
        return TorchPagedAttention(num_heads, num_kv_heads, head_dim, scale)
    raise ConfigError(f"unknown attention backend {name!r}")
