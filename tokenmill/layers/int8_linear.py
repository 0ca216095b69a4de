"""Weight-only int8 linear layers (per-output-row scales), for small draft networks on the CPU.

At a few rows a linear layer streams its weight and does little else, and on a loaded machine
the weight comes from memory, not cache: a 1536 x 256 float32 product took ~360 us cold
against ~60 us hot. Stored as int8 the weight is a quarter of the bytes; torch's
`_weight_int8pack_mm` (the kernel behind weight-only int8 in torchao) with bfloat16 inputs ran
the same product in ~95 us cold and ~65 us hot. Outputs differ from float32 by the
quantization (about 0.4 % of a row's range), so this is for drafts, which verification
checks, never for the target.
"""

from __future__ import annotations

import torch
from torch import nn


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
    """`y = x W^T + b` with W held as int8 rows times a bfloat16 scale per row; float32 in and
    out (the product itself runs in bfloat16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        weight = weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", (weight / scales[:, None]).round().to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(
            x.to(torch.bfloat16), self.weight, self.scales
        ).float()
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"
