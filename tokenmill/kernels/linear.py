"""Few-row dense linears at the memory roof (the C++ `few_row_linear`).

At one to a few rows a linear is a matrix-vector product: its time is the weight's bytes over
the memory bandwidth. torch's `F.linear` at one row streamed 8-13 GB/s on an AMD Zen 5 (AVX-512)
where the native kernel streams the weight once per call at 25-35 GB/s (see
benchmarks/results/2026-12-02-cpu-vs-peers.md); above `NATIVE_LINEAR_MAX_ROWS` oneDNN's blocked
GEMM is faster.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.native import native_kernels

# Rows up to which the native kernel runs (it loads each weight vector once per four rows).
NATIVE_LINEAR_MAX_ROWS = 4


def few_row_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def native_few_row_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """`x @ weight.T + bias` for a 2-D CPU `x` of a few rows in float32 or bfloat16, or None
    where the native kernel does not apply (too many rows, another dtype or device, no build)."""
    if (
        x.dim() != 2
        or x.shape[0] > NATIVE_LINEAR_MAX_ROWS
        or x.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.bfloat16)
        or weight.dtype != x.dtype
        or not weight.is_contiguous()
    ):
        return None
    module = native_kernels()
    if module is None:
        return None
    return module.few_row_linear(x, weight, bias)
