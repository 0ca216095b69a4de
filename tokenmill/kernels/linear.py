"""Dense linears on weights packed once at load time (the C++ `packed_linear`).

The packed layout (blocks of 16 output rows, k-major inside a block; `csrc/linear.h`)
serves every row count: one row is a broadcast times each weight vector, streamed once at the
memory roof; many rows go to AMX tiles (bf16, where the CPU has them) or to AVX-512/AVX2
register tiles. The plain `[n, k]` weight is not kept.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.kernels.native import native_kernels

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packed_linear_available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in PACKED_DTYPES and native_kernels() is not None


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    module = native_kernels()
    assert module is not None, "packed linears need the native kernels"
    return module.pack_linear_weight(weight.detach().contiguous())


def native_dense_linear(packed: torch.Tensor, out_features: int, in_features: int) -> Any:
    """A packed weight as the native `PackedLinear` the fused decoder stack takes (a view)."""
    module = native_kernels()
    assert module is not None, "packed linears need the native kernels"
    return module.PackedLinear.dense(packed, out_features, in_features)


def unpack_linear_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    module = native_kernels()
    assert module is not None, "packed linears need the native kernels"
    return module.unpack_linear_weight(packed, out_features, in_features)


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    float32: bool = False,
) -> torch.Tensor:
    """`x @ W.T + bias` for `x` of any leading shape, in x's dtype (float32 or bfloat16) or,
    with `float32`, in float32."""
    module = native_kernels()
    assert module is not None, "packed linears need the native kernels"
    rows = x.reshape(-1, x.shape[-1])
    out = module.packed_linear(rows, packed, out_features, bias, float32)
    return out.view(*x.shape[:-1], out_features)
