"""int4 linear layers: asymmetric groups of `group_size` weights along the input dimension,
each with a scale and a zero.

A weight is `(q - 8) * scale + zero` with q in [0, 15]: torch's convention, which also holds
llama.cpp's Q4_0 (`d * (q - 8)`: zero 0) and Q4_K (`d * sc * q - dmin * m`: scale `d * sc`,
zero `8 * d * sc - dmin * m`) blocks of 32 exactly, up to the float16 rounding of the scales
and zeros. Where tokenmill's native kernels are built the weight is packed into their
interleaved layout (`kernels/int_linear.py`; activations quantized to int8 per token and block of
32 on CPUs with AVX-512 VNNI); without them it goes to torch's `_weight_int4pack_mm_for_cpu`
(the kernel behind torchao's int4 CPU layout) in bfloat16 (float32 inputs take a reference
path about 40x slower there), whose scales and zeros are bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from tokenmill.kernels.int_linear import pack
from tokenmill.kernels.native import native_kernels
from tokenmill.layers.linear import Linear, LinearMethod, check_shape
from tokenmill.quantization.int8 import Int8GroupWeight
from tokenmill.quantization.int_codes import PackedQuantMethod
from tokenmill.quantization.weight_format import WeightFormat

INT4_GROUP_SIZES = (32, 64, 128)
# Rows of an int4 weight must divide into torch's kernel's tiles (the native one pads).
_TORCH_ROW_MULTIPLE = 16
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

    def regroup(self, group_size: int) -> Int4GroupWeight:
        """The same weight in smaller groups (`group_size` divides this one's): exact, the
        scales and zeros repeated."""
        factor = self.group_size // group_size
        return Int4GroupWeight(
            self.values,
            self.scales.repeat_interleave(factor, 1),
            self.zeros.repeat_interleave(factor, 1),
        )

    def codes(self) -> torch.Tensor:
        """Signed codes, -8..7."""
        return (self.values.to(torch.int16) - 8).to(torch.int8)

    def as_int8(self) -> Int8GroupWeight:
        """The same weight as int8 groups (exact: the codes widen)."""
        return Int8GroupWeight(self.codes(), self.scales.float(), self.zeros.float())


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4GroupWeight:
    """Asymmetric round-to-nearest per group: [min, max] of each group onto 0..15. Scales and
    zeros are rounded to bfloat16 (exact in the native kernels' float16 too, and what torch's
    kernel takes) before the weights are, so `dequantize()` is exactly what the kernels
    multiply by."""
    weight = weight.detach().float()
    rows, cols = weight.shape
    grouped = weight.view(rows, cols // group_size, group_size)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-8).to(_COMPUTE_DTYPE).float()
    zeros = (low + 8 * scales).to(_COMPUTE_DTYPE).float()
    values = ((grouped - zeros[..., None]) / scales[..., None] + 8).round().clamp(0, 15)
    return Int4GroupWeight(values.to(torch.uint8).view(rows, cols), scales, zeros)


def int4_linear_available() -> bool:
    """Whether an int4 kernel runs here: the native one, or torch's (private ops: checked,
    not assumed)."""
    if native_kernels() is not None:
        return True
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


class Int4LinearMethod(PackedQuantMethod):
    """Loads float rows (quantized as they arrive: online quantization) or `Int4GroupWeight`s
    of the same group size (a pre-quantized checkpoint's), then packs them for the kernel."""

    def __init__(self, group_size: int, dequantize_on: torch.device | None = None) -> None:
        self.group_size = group_size
        self.dequantize_on = dequantize_on  # int_codes.py
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
        if loaded.group_size != self.group_size and loaded.group_size % self.group_size == 0:
            loaded = loaded.regroup(self.group_size)  # a fused part in larger groups
        rows = loaded.shape[0]
        check_shape(loaded.shape, layer.qvalues.narrow(0, row_start, rows).shape)
        check_shape(loaded.scales.shape, layer.qscales.narrow(0, row_start, rows).shape)
        layer.qvalues.narrow(0, row_start, rows).copy_(loaded.values)
        layer.qscales.narrow(0, row_start, rows).copy_(loaded.scales)
        layer.qzeros.narrow(0, row_start, rows).copy_(loaded.zeros)

    def process_weights_after_loading(self, layer: Linear) -> None:
        weight = Int4GroupWeight(layer.qvalues, layer.qscales, layer.qzeros)
        for name in ("qvalues", "qscales", "qzeros"):
            delattr(layer, name)
        offsets = weight.zeros if weight.zeros.any() else None
        if self.dequantize_on is not None:
            self.use_torch_ops(layer, weight.codes(), weight.scales, offsets, 4)
            return
        if native_kernels() is not None and layer.dtype in (torch.float32, torch.bfloat16):
            self.use_packed(layer, pack(weight.codes(), weight.scales, offsets, 4, self.group_size))
            return
        self.use_cpu_op(layer)
        layer.packed_weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.values.to(torch.int32), 1
        )
        scale_zeros = torch.stack([weight.scales, weight.zeros], dim=-1).transpose(0, 1)
        layer.scale_zeros = scale_zeros.contiguous().to(_COMPUTE_DTYPE)

    def torch_apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(_COMPUTE_DTYPE), layer.packed_weight, self.group_size, layer.scale_zeros
        ).to(x.dtype)
        return out if layer.bias is None else out + layer.bias


def int4_shape_supported(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether a weight of this shape has an int4 layout here (whole groups; torch's kernel
    also needs rows in tiles of 16, the native one pads them; both need whole blocks of 32)."""
    if in_features % group_size or in_features % 32:
        return False
    return native_kernels() is not None or out_features % _TORCH_ROW_MULTIPLE == 0


class Int4Format(WeightFormat):
    """int4 in asymmetric groups (`int4-g32`, `int4-g64`, `int4-g128`): `--quantization
    int4`, GPTQ, AWQ, W4A16 and GGUF Q4 checkpoints. A layer whose shape the CPU kernel cannot
    take gets int8 per row instead."""

    family = "int4"
    online = MappingProxyType({"int4": "int4-g32", "int4-g128": "int4-g128"})
    fallback = "int8"

    def owns(self, name: str) -> bool:
        return name.startswith("int4-g")

    def kernel_available(self) -> bool:
        return int4_linear_available()

    def method(self, name: str, dequantize_on: torch.device | None) -> LinearMethod:
        return Int4LinearMethod(_group_size(name), dequantize_on=dequantize_on)

    def fits(
        self, name: str, out_features: int, in_features: int, dequantize_on: torch.device | None
    ) -> bool:
        group_size = _group_size(name)
        return dequantize_on is not None or int4_shape_supported(
            out_features, in_features, group_size
        )

    def embedding_lookup(self) -> bool:
        return native_kernels() is not None  # torch's int4 layout cannot be read back


def _group_size(name: str) -> int:
    return int(name.removeprefix("int4-g"))


INT4 = Int4Format()
