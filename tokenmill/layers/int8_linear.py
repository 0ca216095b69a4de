"""Weight-only int8 linear layers (per-output-row scales), for small draft networks on the CPU.

At a few rows a linear layer streams its weight and does little else, and on a loaded machine
the weight comes from memory, not cache: a 1536 x 256 float32 product took ~360 us cold
against ~60 us hot. Stored as int8 the weight is a quarter of the bytes; torch's
`_weight_int8pack_mm` (the kernel behind weight-only int8 in torchao) with bfloat16 inputs ran
the same product in ~95 us cold and ~65 us hot. Outputs differ from float32 by the
quantization (about 0.4 % of a row's range), so this is for drafts, which verification
checks, never for the target.

The kernel is slow once the product has rows to amortise the weight over: at 8 rows it took
2.2x oneDNN's float32 time, at 64 rows 2x. So more than `MAX_INT8_ROWS` rows go to the float
layer, kept beside the int8 copy (a draft's layers are small; 4 bytes a weight more).
"""

from __future__ import annotations

import torch
from torch import nn

# Rows up to which the int8 product runs; more go to the float layer.
MAX_INT8_ROWS = 4


def int8_linear_available() -> bool:
    """Whether this torch has the CPU kernel (a private op: checked, not assumed)."""
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    try:
        weight = torch.ones(8, 32, dtype=torch.int8)
        scales = torch.ones(8, dtype=torch.bfloat16)
        torch.ops.aten._weight_int8pack_mm(torch.ones(1, 32, dtype=torch.bfloat16), weight, scales)
    except (RuntimeError, NotImplementedError):
        return False
    return True


class Int8Linear(nn.Module):
    """`y = x W^T + b` with W held as int8 rows times a bfloat16 scale per row (the product in
    bfloat16, float32 in and out) for up to MAX_INT8_ROWS rows; more rows go to `full`, the
    float layer (converted with the rest of the model, e.g. to oneDNN's layout)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        weight = weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", (weight / scales[:, None]).round().to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.full: nn.Module | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The int8 copy of `linear`, which it keeps for products of many rows."""
        module = cls(linear.weight, linear.bias)
        module.full = linear
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.full is not None and x.shape[0] > MAX_INT8_ROWS:
            return self.full(x)
        out = torch.ops.aten._weight_int8pack_mm(
            x.to(torch.bfloat16), self.weight, self.scales
        ).float()
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"
