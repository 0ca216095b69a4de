"""The native MoE kernel (csrc/moe.cpp): a block's routed experts in one call, each expert's
two products in its own weight format (the `PackedLinear` its `LinearMethod` gives the fused
decoder stack too: dense float32/bf16 packed, int8, int4), tokens grouped by expert, a token
batch of one reading only its k experts' weights.

It applies on the CPU where the kernels build and every expert's method has a native product
(the default `linear_backend`); elsewhere (`linear_backend="torch"`, CUDA, a format without
one) the block runs layers/fused_moe.py's torch reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tokenmill.kernels.native import native_kernels

# (x [T, H], weights [T, k] float32, ids [T, k] int64) -> the routed experts' sum [T, H]
ExpertsKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def native_moe_experts(experts: Sequence[nn.Module], x: torch.Tensor) -> ExpertsKernel | None:
    """The kernel over `experts` (each with `gate_up_proj`, `down_proj` and
    `intermediate_size`) for inputs like `x`, or None where it does not apply."""
    module = native_kernels()
    if module is None or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    gate_up = [_native_linear(expert.gate_up_proj) for expert in experts]
    down = [_native_linear(expert.down_proj) for expert in experts]
    if any(linear is None for linear in [*gate_up, *down]):
        return None
    kernel = module.MoEExperts(gate_up, down, experts[0].intermediate_size)

    def run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return kernel.forward(x.contiguous(), weights.float().contiguous(), ids.contiguous())

    return run


def _native_linear(linear: nn.Module) -> Any | None:
    method = getattr(linear, "quant_method", None)
    return None if method is None else method.native_linear(linear)
