"""Linear layers with weights reordered once for oneDNN, for float32 on the CPU.

`F.linear` on float32 CPU tensors goes to a BLAS whose kernels here (AMD Zen 5, AVX-512)
reached 200 GFLOP/s at 2048 rows and far less at a few rows (5 rows of a 1536 x 256 weight:
68 us, vs 25 us for one row). oneDNN with the weight reordered into its blocked layout ran
the same products 2.2-3x faster at every row count from 5 to 2048; at one row it wins for
large weights only (below). The reorder is what `torch.compile` with freezing does to a
CPU model; doing it at load time needs no compiler. Outputs agree with `F.linear` to float32
rounding (different summation order).

Row counts are padded up to a few sizes (`padded_rows`). oneDNN JIT-compiles a primitive per
input shape and two caches keep them (ideep's and oneDNN's, 1024 entries each): with every
row count a new shape, a server's resident memory grew by ~750 MB over its first few thousand
requests (0.6-1 MB per primitive) before the caches filled, and each new shape paid its
compilation inside a step. Padding bounds both: 72 shapes per weight up to 2048 rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.linear import NATIVE_LINEAR_MAX_ROWS, native_few_row_linear
from tokenmill.kernels.native import native_kernels

# Rows the reordered layout is tuned for; measured the same from 16 to 256.
_ROWS_HINT = 16
# A oneDNN call costs ~12 us however small the product, where F.linear of one row through a
# weight of a few hundred thousand elements costs 4-30 us. Weights under this size are kept in
# torch's layout too (little memory: they are small) and single rows go to F.linear. Set from
# the engine, not a micro-benchmark: the demo target at batch 1 ran 0.89x with 300K here,
# 1.07x with 600K; a 79M model (larger weights, oneDNN even for one row) 1.55x.
_SMALL_WEIGHT_ELEMENTS = 600_000
# Rows up to which those small weights go to F.linear: on an Intel Xeon (AVX-512) one
# layer's five demo-target products cost the same 182 us for 1-3 rows there (the weights
# stream once), against 260 us in oneDNN at any of 1-6 rows; at 4 rows F.linear cost 268.
_SMALL_WEIGHT_ROWS = 3


def padded_rows(num_rows: int) -> int:
    """`num_rows` as it is up to 8 (8 shapes; padding 5 rows to 8 cost 1.24x on an Intel Xeon
    with AVX-512, where 1-6 rows cost the same), above that rounded up to a multiple of an
    eighth of its power of two (at most 12.5% more rows)."""
    if num_rows <= 8:
        return max(num_rows, 1)
    step = 1 << max(num_rows.bit_length() - 4, 0)
    return -(-num_rows // step) * step


def onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


class OneDNNLinear(nn.Module):
    """`nn.Linear` inference with the weight held in oneDNN's layout (no gradient)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.small_weight = weight if weight.numel() < _SMALL_WEIGHT_ELEMENTS else None
        # Few rows: the native GEMV (kernels/linear.py) reads torch's layout at the memory roof.
        self.weight = weight if native_kernels() is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.shape[0]
        if self.weight is not None and num_rows <= NATIVE_LINEAR_MAX_ROWS:
            out = native_few_row_linear(x, self.weight, self.bias)
            if out is not None:
                return out
        if self.small_weight is not None and num_rows <= _SMALL_WEIGHT_ROWS:
            return F.linear(x, self.small_weight, self.bias)
        padding = padded_rows(num_rows) - num_rows
        if padding:
            x = F.pad(x, (0, 0, 0, padding))
        out = torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return out[:num_rows] if padding else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"


def use_onednn_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a `OneDNNLinear`; returns how many. For
    float32 models on the CPU, after the weights are loaded."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, OneDNNLinear(child))
                replaced += 1
    return replaced
