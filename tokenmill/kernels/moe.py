"""The native MoE kernel (csrc/moe.cpp): a block's routed experts in one call, each expert's
two products in its own weight format (the `PackedLinear` its `LinearMethod` gives the fused
decoder stack too: dense float32/bf16 packed, int8, int4; gpt-oss's MXFP4 as 5-bit codes),
tokens grouped by expert, a token batch of one reading only its k experts' weights. Optional
per-expert biases and two activations: SiLU-gated (Mixtral, Qwen) and gpt-oss's clamped
SwiGLU on interleaved gate/up columns. Up to `ONE_JOB_MAX_PAIRS` (token, expert) pairs a call
is one pool job whose phases each cover every active expert (llama.cpp's `mul_mat_id` shape);
larger calls run each expert's products in turn.

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
SILU, CLAMPED_SWIGLU = 0, 1  # csrc/moe.h's MoEActivation
# (token, expert) pairs up to which a call runs as one pool job over every active expert's
# blocks (decode, small batches: the k experts' products share the threads); above it (a
# prefill chunk) each expert's products run in turn, each big enough to fill the threads, and
# the one job's whole-batch buffers (~20 KB a pair at Qwen3-30B-A3B's widths) are not made.
ONE_JOB_MAX_PAIRS = 1024


def applies_to(x: torch.Tensor) -> bool:
    """Whether the kernel runs on inputs like `x` (CPU, float32 or bfloat16, kernels built)."""
    return (
        native_kernels() is not None
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
    )


def moe_kernel(
    gate_up: Sequence[Any],
    down: Sequence[Any],
    intermediate_size: int,
    biases: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
    activation: int = SILU,
    alpha: float = 1.702,
    limit: float = 7.0,
    per_expert: bool | None = None,
) -> ExpertsKernel:
    """The kernel over per-expert native products (`PackedLinear`s), with `biases` (gate/up's
    and down's, one per expert) and `activation`'s `alpha` and `limit` (CLAMPED_SWIGLU).
    `per_expert`: True, each active expert's products in turn; False, one pool job over every
    active expert's blocks (equal to the other bit for bit); None, by the call's size
    (`ONE_JOB_MAX_PAIRS`)."""
    module = native_kernels()
    assert module is not None, "the MoE kernel needs the native kernels"
    gate_up_bias, down_bias = biases if biases is not None else ([], [])
    arguments = (list(gate_up), list(down), intermediate_size, list(gate_up_bias),
                 list(down_bias), activation, alpha, limit)  # fmt: skip
    one_job, in_turn = module.MoEExperts(*arguments), module.MoEExperts(*arguments)
    in_turn.set_per_expert(True)

    def run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        turns = per_expert if per_expert is not None else ids.numel() > ONE_JOB_MAX_PAIRS
        kernel = in_turn if turns else one_job
        return kernel.forward(x.contiguous(), weights.float().contiguous(), ids.contiguous())

    return run


def native_moe_experts(
    experts: Sequence[nn.Module], x: torch.Tensor, per_expert: bool | None = None
) -> ExpertsKernel | None:
    """The kernel over `experts` (each with `gate_up_proj`, `down_proj` and
    `intermediate_size`) for inputs like `x`, or None where it does not apply (`per_expert`:
    as `moe_kernel`'s)."""
    if not applies_to(x):
        return None
    gate_up = [_native_linear(expert.gate_up_proj) for expert in experts]
    down = [_native_linear(expert.down_proj) for expert in experts]
    if any(linear is None for linear in [*gate_up, *down]):
        return None
    return moe_kernel(gate_up, down, experts[0].intermediate_size, per_expert=per_expert)


def _native_linear(linear: nn.Module) -> Any | None:
    method = getattr(linear, "quant_method", None)
    return None if method is None else method.native_linear(linear)
