"""int8 linear layers: int8 weights with a scale per output row (`--quantization int8`,
compressed-tensors W8A8) or per group of input columns (GGUF's Q8_0 and Q5_0 blocks of 32,
Q6_K's of 16, kept as they are), optionally with an offset per group (Q5_K, or Q4_K inside a
fused layer whose other part is wider). Codes that need fewer bits (GGUF's 5- and 6-bit
types) are packed at their own width (`code_bits`: `int5-g32`, `int6-g16`): the same method,
a narrower layout, so that resident bytes stay those of the file.

Where tokenmill's native kernels are built (`kernels/int_linear.py`) the weight is packed into
their interleaved layout and that is all the layer holds; on a CPU with AVX-512 VNNI the
activations are quantized to int8 per token and block of 32 at run time (W8A8 dynamic), on
others they stay float. Without the native kernels the weight goes to torch's
`_weight_int8pack_mm` (per-row scales only: group scales are folded into one per row, one
more rounding; the product in bfloat16: float32 inputs take a reference path 20x slower).

A draft network (`spec_decode/head_checkpoint.py`) keeps its float weight beside the int8
copy and sends more than `MAX_INT8_ROWS` rows to a dense `fallback` method.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from tokenmill.config import ConfigError
from tokenmill.kernels.int_linear import IQ4_NL_VALUES, code_range, pack
from tokenmill.kernels.native import native_kernels
from tokenmill.layers.linear import Linear, LinearMethod, check_shape
from tokenmill.quantization.int_codes import PackedQuantMethod
from tokenmill.quantization.weight_format import WeightFormat

# Rows up to which a draft's int8 product runs; more go to its float fallback.
MAX_INT8_ROWS = 4
_TORCH_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Int8GroupWeight:
    """A checkpoint's int8 weight: `values` int8 `[rows, in]`, `scales` float `[rows, groups]`
    (one group: per output row), `offsets` like scales or None; weight = values * scale +
    offset over each group of `in / groups` columns."""

    values: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def group_size(self) -> int:
        return self.values.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        rows, cols = self.values.shape
        grouped = self.values.float().view(rows, -1, self.group_size) * self.scales[..., None]
        if self.offsets is not None:
            grouped = grouped + self.offsets[..., None]
        return grouped.view(rows, cols)

    def regroup(self, group_size: int) -> Int8GroupWeight:
        """The same weight in groups of `group_size` (a divisor of the current size: each
        scale repeated)."""
        factor = self.group_size // group_size
        offsets = None if self.offsets is None else self.offsets.repeat_interleave(factor, 1)
        return Int8GroupWeight(self.values, self.scales.repeat_interleave(factor, 1), offsets)

    def permute_rows(self, order: torch.Tensor) -> Int8GroupWeight:
        offsets = None if self.offsets is None else self.offsets[order]
        return Int8GroupWeight(self.values[order], self.scales[order], offsets)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> Int8GroupWeight:
    """Symmetric round-to-nearest per output row (or per group of `group_size` columns): the
    largest |w| onto 127. Scales are rounded to float16 (the kernels' scale type) first, so
    `dequantize()` is exactly what the kernels multiply by."""
    weight = weight.detach().float()
    rows, cols = weight.shape
    grouped = weight.view(rows, -1, cols if group_size is None else group_size)
    amax = grouped.abs().amax(dim=-1).clamp(min=1e-8)
    scales = (amax / 127.0).to(torch.float16).float()
    values = (grouped / scales[..., None]).round().clamp(-127, 127).to(torch.int8)
    return Int8GroupWeight(values.view(rows, cols), scales)


def int8_linear_available() -> bool:
    """Whether an int8 kernel runs here: the native one, or torch's (a private op: checked,
    not assumed)."""
    if native_kernels() is not None:
        return True
    if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return False
    try:
        weight = torch.ones(8, 32, dtype=torch.int8)
        scales = torch.ones(8, dtype=_TORCH_DTYPE)
        torch.ops.aten._weight_int8pack_mm(torch.ones(1, 32, dtype=_TORCH_DTYPE), weight, scales)
    except (RuntimeError, NotImplementedError):
        return False
    return True


class Int8LinearMethod(PackedQuantMethod):
    """int8 codes with a scale per output row (`group_size` None) or per group, and offsets
    for groups where the checkpoint has them. Loads float rows (quantized as they arrive:
    online quantization), `Int8GroupWeight`s (kept as they are) or `Int4GroupWeight`s (their
    codes widened, exactly). `code_bits` 6, 5, 3 or 2: the checkpoint's codes fit that width
    and the native kernels pack them at it. With a `fallback`, the layer keeps its float weight too
    and products of more than `max_rows` rows are the fallback's. `dequantize_on`: the device
    whose torch ops run the layer (int_codes.py); None: the CPU's kernels."""

    def __init__(
        self,
        group_size: int | None = None,
        fallback: LinearMethod | None = None,
        max_rows: int = MAX_INT8_ROWS,
        code_bits: int = 8,
        dequantize_on: torch.device | None = None,
        codebook: torch.Tensor | None = None,
    ) -> None:
        self.dequantize_on = dequantize_on
        self.group_size = group_size
        self.fallback = fallback
        self.max_rows = max_rows
        self.code_bits = 4 if codebook is not None else code_bits
        self.codebook = codebook
        self.holds_float_weight = fallback is not None
        kind = "iq4nl" if codebook is not None else f"int{code_bits}"
        self.weight_format = kind + ("" if group_size is None else f"-g{group_size}")

    def create_weights(self, layer: Linear, weight: torch.nn.Parameter | None) -> None:
        rows, cols = layer.out_features, layer.in_features
        groups = 1 if self.group_size is None else cols // self.group_size
        layer.register_buffer("qweight", torch.zeros(rows, cols, dtype=torch.int8))
        layer.register_buffer("scales", torch.zeros(rows, groups))
        if self.group_size is not None:
            layer.register_buffer("offsets", torch.zeros(rows, groups))
        if self.fallback is not None:
            self.fallback.create_weights(layer, weight)

    def load_weight(self, layer: Linear, loaded: object, row_start: int) -> None:
        if self.fallback is not None:
            self.fallback.load_weight(layer, loaded, row_start)
            return  # quantized from the float weight once loaded
        weight = self._as_int8(loaded)
        rows = weight.shape[0]
        check_shape(weight.shape, layer.qweight.narrow(0, row_start, rows).shape)
        check_shape(weight.scales.shape, layer.scales.narrow(0, row_start, rows).shape)
        layer.qweight.narrow(0, row_start, rows).copy_(weight.values)
        layer.scales.narrow(0, row_start, rows).copy_(weight.scales)
        if weight.offsets is not None:
            layer.offsets.narrow(0, row_start, rows).copy_(weight.offsets)

    def _as_int8(self, loaded: object) -> Int8GroupWeight:
        if hasattr(loaded, "as_int8"):
            loaded = loaded.as_int8()  # int4 groups, widened exactly
        if isinstance(loaded, Int8GroupWeight) and self._fits(loaded):
            return loaded
        if (
            isinstance(loaded, Int8GroupWeight)
            and self.group_size is not None
            and loaded.group_size % self.group_size == 0
        ):
            return loaded.regroup(self.group_size)  # exact: scales repeated
        if not isinstance(loaded, torch.Tensor) and hasattr(loaded, "dequantize"):
            loaded = loaded.dequantize()  # another grouping: one more rounding
        if not isinstance(loaded, torch.Tensor):
            raise TypeError(f"an int8 linear cannot load {type(loaded).__name__}")
        return quantize_int8(loaded, self.group_size)

    def _fits(self, weight: Int8GroupWeight) -> bool:
        if self.group_size is None:
            return weight.scales.shape[1] == 1 and weight.offsets is None
        return weight.group_size == self.group_size

    def process_weights_after_loading(self, layer: Linear) -> None:
        if self.fallback is not None:
            quantized = quantize_int8(layer.weight)
            layer.qweight.copy_(quantized.values)
            layer.scales.copy_(quantized.scales)
            self.fallback.process_weights_after_loading(layer)
        offsets = getattr(layer, "offsets", None)
        if offsets is not None and not offsets.any():
            offsets = None
        weight = Int8GroupWeight(layer.qweight, layer.scales, offsets)
        for name in ("qweight", "scales", "offsets"):
            if hasattr(layer, name):
                delattr(layer, name)
        self._check_code_range(weight.values)
        if self.dequantize_on is not None:
            self.use_torch_ops(layer, weight.values, weight.scales, weight.offsets, 8)
            return
        if native_kernels() is not None and layer.dtype in (torch.float32, torch.bfloat16):
            packed = pack(
                weight.values,
                weight.scales,
                weight.offsets,
                self.code_bits,
                self.group_size,
                self.codebook,
            )
            self.use_packed(layer, packed)
            return
        if weight.scales.shape[1] > 1 or weight.offsets is not None:
            weight = quantize_int8(weight.dequantize())  # torch's kernel: per-row scales only
        self.use_cpu_op(layer)
        layer.qweight, layer.row_scales = weight.values, weight.scales[:, 0].to(_TORCH_DTYPE)

    def _check_code_range(self, codes: torch.Tensor) -> None:
        if self.codebook is not None:
            if not torch.isin(codes, self.codebook).all():
                raise ConfigError(
                    f"{self.weight_format} weight with codes outside its table: the "
                    "checkpoint's blocks do not match their declared type"
                )
            return
        low, high = code_range(self.code_bits)
        if self.code_bits < 8 and (codes.min() < low or codes.max() > high):
            raise ConfigError(
                f"{self.weight_format} weight with codes outside [{low}, {high}]: the "
                "checkpoint's blocks do not match their declared type"
            )

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self._falls_back(x):
            return self.fallback.apply(layer, x)
        return super().apply(layer, x)

    def apply_float32(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self._falls_back(x):
            return self.fallback.apply_float32(layer, x)
        return super().apply_float32(layer, x)

    def _falls_back(self, x: torch.Tensor) -> bool:
        return self.fallback is not None and x.shape[0] > self.max_rows

    def native_linear(self, layer: Linear) -> Any | None:
        return None if self.fallback is not None else super().native_linear(layer)

    def torch_apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(
            x.to(_TORCH_DTYPE), layer.qweight, layer.row_scales
        ).to(x.dtype)
        return out if layer.bias is None else out + layer.bias

    def dequantize_rows(self, layer: Linear, rows: torch.Tensor) -> torch.Tensor:
        """float32 rows `rows` of the weight (an embedding's lookup from a tied LM head)."""
        if layer.packed is not None or layer.torch_weight is not None:
            return super().dequantize_rows(layer, rows)
        return layer.qweight[rows].float() * layer.row_scales[rows].float()[:, None]


def int8_linear(
    weight: torch.Tensor, bias: torch.Tensor | None, fallback: LinearMethod | None = None
) -> Linear:
    """An int8 `Linear` quantized from a loaded float `weight` (`[out, in]`); with a
    `fallback` (a draft's layers) it keeps the float weight for products of many rows."""
    out_features, in_features = weight.shape
    bias_param = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
    method = Int8LinearMethod(fallback=fallback)
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


class Int8Format(WeightFormat):
    """int8 codes with a scale per output row (`int8`: `--quantization int8`, W8A8
    checkpoints), or per group with codes of 8, 6, 5, 3 or 2 bits (`int8-g32`, `int6-g16`,
    `int5-g32`, `int3-g16`, `int2-g16`: GGUF's blocks) or IQ4 table values held as indices
    (`iq4nl-g32`)."""

    family = "int8"
    online = MappingProxyType({"int8": "int8"})

    def owns(self, name: str) -> bool:
        return name == "int8" or name.startswith(_IQ4) or _grouped_bits(name) is not None

    def kernel_available(self) -> bool:
        return int8_linear_available()

    def method(self, name: str, dequantize_on: torch.device | None) -> LinearMethod:
        if name == "int8":
            return Int8LinearMethod(dequantize_on=dequantize_on)
        if name.startswith(_IQ4):
            group = int(name.removeprefix(_IQ4))
            return Int8LinearMethod(group, dequantize_on=dequantize_on, codebook=IQ4_NL_VALUES)
        bits = _grouped_bits(name)
        assert bits is not None, name
        group_size = int(name.removeprefix(f"int{bits}-g"))
        return Int8LinearMethod(group_size, code_bits=bits, dequantize_on=dequantize_on)


_IQ4 = "iq4nl-g"


def _grouped_bits(name: str) -> int | None:
    """The code width of a grouped name (`int<bits>-g<group>`), or None."""
    for bits in (8, 6, 5, 3, 2):  # int8 codes, or GGUF's narrower ones at their own width
        if name.startswith(f"int{bits}-g"):
            return bits
    return None


INT8 = Int8Format()
