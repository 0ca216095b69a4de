"""Weight-only int8 linear layers: int8 weights with one scale per output row, multiplied by
torch's `_weight_int8pack_mm` (the kernel behind torchao's weight-only int8) in bfloat16.

At a few rows a linear layer streams its weight and does little else, and on a loaded machine
the weight comes from memory, not cache: a 1536 x 256 float32 product took ~360 us cold
against ~60 us hot. Stored as int8 the weight is a quarter of the bytes; the int8 kernel with
bfloat16 inputs ran the same product in ~95 us cold and ~65 us hot (float32 inputs take a
reference path 20x slower, so the product is always in bfloat16). Outputs differ from float32
by the quantization (about 0.4 % of a row's range) and the bfloat16 rounding of the input.

The kernel is slow once the product has rows to amortise the weight over: at 8 rows it took
2.2x oneDNN's float32 time, at 64 rows 2x. A draft network (`spec_decode/head_checkpoint.py`)
therefore keeps its float weight beside the int8 copy and sends more than `MAX_INT8_ROWS`
rows to a dense `fallback` method (a draft's layers are small; 4 bytes a weight more).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.linear import Linear, LinearMethod, check_shape

# Rows up to which a draft's int8 product runs; more go to its float fallback.
MAX_INT8_ROWS = 4
_COMPUTE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Int8ChannelWeight:
    """A checkpoint's int8 weight: `values` int8 `[rows, in]`, `scales` float `[rows]`
    (weight = values * scales)."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales.float()[:, None]


def quantize_int8(weight: torch.Tensor) -> Int8ChannelWeight:
    """Symmetric per-row int8: each row to 127 steps of its largest magnitude. The scales
    are rounded to bfloat16 first, so `dequantize()` is what the kernel multiplies by."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(_COMPUTE_DTYPE).float()
    values = (weight / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return Int8ChannelWeight(values, scales)


def int8_linear_available() -> bool:
    """Whether this torch has the CPU kernel (a private op: checked, not assumed)."""
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    try:
        weight = torch.ones(8, 32, dtype=torch.int8)
        scales = torch.ones(8, dtype=_COMPUTE_DTYPE)
        torch.ops.aten._weight_int8pack_mm(torch.ones(1, 32, dtype=_COMPUTE_DTYPE), weight, scales)
    except (RuntimeError, NotImplementedError):
        return False
    return True


class Int8LinearMethod(LinearMethod):
    """int8 weights (`layer.qweight`) times a scale per output row (`layer.scales`). Loads
    float rows (quantized as they arrive: online quantization) or `Int8ChannelWeight`s (a
    pre-quantized checkpoint's, kept as they are). With a `fallback`, the layer keeps its
    float weight too and products of more than `max_rows` rows are the fallback's."""

    weight_format = "int8"

    def __init__(self, fallback: LinearMethod | None = None, max_rows: int = MAX_INT8_ROWS):
        self.fallback = fallback
        self.max_rows = max_rows
        self.holds_float_weight = fallback is not None

    def create_weights(self, layer: Linear, weight: torch.nn.Parameter | None) -> None:
        shape = (layer.out_features, layer.in_features)
        layer.register_buffer("qweight", torch.zeros(shape, dtype=torch.int8))
        layer.register_buffer("scales", torch.zeros(layer.out_features))
        if self.fallback is not None:
            self.fallback.create_weights(layer, weight)

    def load_weight(self, layer: Linear, loaded: object, row_start: int) -> None:
        if self.fallback is not None:
            self.fallback.load_weight(layer, loaded, row_start)
            return  # quantized from the float weight once loaded
        if not isinstance(loaded, torch.Tensor | Int8ChannelWeight) and hasattr(
            loaded, "dequantize"
        ):
            loaded = loaded.dequantize()  # int4 groups for a layer the int4 kernel cannot take
        if isinstance(loaded, torch.Tensor):
            loaded = quantize_int8(loaded)
        if not isinstance(loaded, Int8ChannelWeight):
            raise TypeError(f"an int8 linear cannot load {type(loaded).__name__}")
        rows = loaded.shape[0]
        check_shape(loaded.shape, layer.qweight.narrow(0, row_start, rows).shape)
        layer.qweight.narrow(0, row_start, rows).copy_(loaded.values)
        layer.scales.narrow(0, row_start, rows).copy_(loaded.scales)

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.fallback is not None:
            quantized = quantize_int8(layer.weight)
            layer.qweight.copy_(quantized.values)
            layer.scales.copy_(quantized.scales)
            self.fallback.process_weights_after_loading(layer)
        layer.scales = layer.scales.to(_COMPUTE_DTYPE)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.fallback is not None and x.shape[0] > self.max_rows:
            return self.fallback.apply(layer, x)
        out = torch.ops.aten._weight_int8pack_mm(x.to(_COMPUTE_DTYPE), layer.qweight, layer.scales)
        out = out.to(x.dtype)
        return out if layer.bias is None else out + layer.bias


def int8_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, fallback: LinearMethod | None = None
) -> Linear:
    """An int8 `Linear` quantized from a loaded float `weight` (`[out, in]`); with a
    `fallback` (a draft's layers) it keeps the float weight for products of many rows."""
    out_features, in_features = weight.shape
    bias_param = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
    method = Int8LinearMethod(fallback)
    float_weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
    layer = Linear(
        in_features,
        out_features,
        method,
        bias=bias_param,
        weight=float_weight if fallback is not None else None,
        dtype=weight.dtype,
    )
    if fallback is None:
        method.load_weight(layer, weight, 0)
    method.process_weights_after_loading(layer)
    return layer
