"""Weight-only int4 linear layers: asymmetric groups of `group_size` weights along the input
dimension, each with a scale and a zero, multiplied by torch's `_weight_int4pack_mm_for_cpu`
(the kernel behind torchao's int4 weight-only CPU layout) in bfloat16.

A weight is `(q - 8) * scale + zero` with q in [0, 15]: torch's convention, which also holds
llama.cpp's Q4_0 (`d * (q - 8)`: zero 0) and Q4_K (`d * sc * q - dmin * m`: scale `d * sc`,
zero `8 * d * sc - dmin * m`) blocks of 32 exactly, up to the bfloat16 rounding of the scales
and zeros. The product is in bfloat16 whatever the model's dtype: float32 inputs take a
reference path about 40x slower here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.linear import Linear, LinearMethod, check_shape

INT4_GROUP_SIZES = (32, 64, 128)
_COMPUTE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Int4GroupWeight:
    """An int4 weight before packing: `values` uint8 `[rows, in]` in [0, 15], `scales` and
    `zeros` float `[rows, in // group_size]`; weight = (values - 8) * scales + zeros."""

    values: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def group_size(self) -> int:
        return self.values.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.values.shape
        grouped = self.values.float().view(rows, -1, self.group_size) - 8
        weight = grouped * self.scales.float()[..., None] + self.zeros.float()[..., None]
        return weight.view(rows, cols)

    def permute_rows(self, order: torch.Tensor) -> Int4GroupWeight:
        return Int4GroupWeight(self.values[order], self.scales[order], self.zeros[order])


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4GroupWeight:
    """Asymmetric round-to-nearest per group: [min, max] of each group onto 0..15. Scales and
    zeros are rounded to bfloat16 before the weights are, so `dequantize()` is exactly what
    the kernel multiplies by."""
    weight = weight.detach().float()
    rows, cols = weight.shape
    grouped = weight.view(rows, cols // group_size, group_size)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-8).to(_COMPUTE_DTYPE).float()
    zeros = (low + 8 * scales).to(_COMPUTE_DTYPE).float()
    values = ((grouped - zeros[..., None]) / scales[..., None] + 8).round().clamp(0, 15)
    return Int4GroupWeight(values.to(torch.uint8).view(rows, cols), scales, zeros)


def int4_linear_available() -> bool:
    """Whether this torch has the CPU kernels (private ops: checked, not assumed)."""
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.zeros(16, 64, dtype=torch.int32), 1
        )
        scale_zeros = torch.ones(2, 16, 2, dtype=_COMPUTE_DTYPE)
        x = torch.ones(1, 64, dtype=_COMPUTE_DTYPE)
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scale_zeros)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


class Int4LinearMethod(LinearMethod):
    """Loads float rows (quantized as they arrive: online quantization) or `Int4GroupWeight`s
    of the same group size (a pre-quantized checkpoint's), then packs them for the kernel."""

    holds_float_weight = False

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.weight_format = f"int4-g{group_size}"

    def create_weights(self, layer: Linear, weight: torch.nn.Parameter | None) -> None:
        rows, cols = layer.out_features, layer.in_features
        groups = (rows, cols // self.group_size)
        layer.register_buffer("qvalues", torch.zeros(rows, cols, dtype=torch.uint8))
        layer.register_buffer("qscales", torch.zeros(groups))
        layer.register_buffer("qzeros", torch.zeros(groups))

    def load_weight(self, layer: Linear, loaded: object, row_start: int) -> None:
        if isinstance(loaded, torch.Tensor):
            check_shape(loaded.shape, (loaded.shape[0], layer.in_features))
            loaded = quantize_int4(loaded, self.group_size)
        if not isinstance(loaded, Int4GroupWeight):
            raise TypeError(f"an int4 linear cannot load {type(loaded).__name__}")
        rows = loaded.shape[0]
        check_shape(loaded.shape, layer.qvalues.narrow(0, row_start, rows).shape)
        check_shape(loaded.scales.shape, layer.qscales.narrow(0, row_start, rows).shape)
        layer.qvalues.narrow(0, row_start, rows).copy_(loaded.values)
        layer.qscales.narrow(0, row_start, rows).copy_(loaded.scales)
        layer.qzeros.narrow(0, row_start, rows).copy_(loaded.zeros)

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.packed_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            layer.qvalues.to(torch.int32), 1
        )
        scale_zeros = torch.stack([layer.qscales, layer.qzeros], dim=-1).transpose(0, 1)
        layer.scale_zeros = scale_zeros.contiguous().to(_COMPUTE_DTYPE)
        for name in ("qvalues", "qscales", "qzeros"):
            delattr(layer, name)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(_COMPUTE_DTYPE), layer.packed_weight, self.group_size, layer.scale_zeros
        ).to(x.dtype)
        return out if layer.bias is None else out + layer.bias
