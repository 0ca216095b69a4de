"""What the int8 and int4 linear methods share: where their weight lives and how it is
multiplied. Three storages, chosen once after loading:

- the native kernels (CPU): the layer holds its weight packed (`layer.packed`,
  kernels/int_linear.py) and the native `PackedLinear` over it (`layer.native`), which its products
  call and the fused decoder stack multiplies;
- dequantized per call with torch ops (`layer.torch_weight`, any device: CUDA, or the CPU
  under `--linear-backend torch`): the codes stay on the device, and each product widens them
  into a float weight for `F.linear`. Correct everywhere, not fast (the whole weight is
  written once per product): the path for devices that have no kernel of ours yet;
- torch's own CPU ops (`torch_apply`), where the native kernels are not built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tokenmill.kernels.int_linear import PackedWeight, native_quant_linear
from tokenmill.layers.linear import Linear, LinearMethod


@dataclass(frozen=True)
class TorchGroupedWeight:
    """Codes for the torch path, on the layer's device: int8 `[out, in]`, or for 4-bit codes
    two per byte (`[out, in / 2]` uint8: column 2i in the low nibble, stored + 8); scales and
    offsets `[out, groups]` in the layer's dtype. weight = code * scale + offset per group."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int

    @classmethod
    def of(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
        bits: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> TorchGroupedWeight:
        """From signed `codes` `[out, in]` and float `scales` (`offsets`) `[out, groups]`."""
        if bits == 4:
            unsigned = (codes.to(torch.int16) + 8).to(torch.uint8)
            codes = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
        else:
            codes = codes.to(torch.int8)
        return cls(
            codes.contiguous().to(device),
            scales.to(device=device, dtype=dtype),
            None if offsets is None else offsets.to(device=device, dtype=dtype),
            bits,
        )

    def rows(self, rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Rows `rows` (None: all) of the weight, `[len(rows), in]` in `dtype`."""
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        codes = pick(self.codes)
        if self.bits == 4:
            nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(1)
            values = nibbles.to(dtype) - 8
        else:
            values = codes.to(dtype)
        scales = pick(self.scales).to(dtype)
        grouped = values.view(values.shape[0], scales.shape[1], -1) * scales[..., None]
        if self.offsets is not None:
            grouped = grouped + pick(self.offsets).to(dtype)[..., None]
        return grouped.flatten(1)


class PackedQuantMethod(LinearMethod):
    """`dequantize_on`: the device whose torch ops run the layer (module docstring); None:
    the CPU's kernels."""

    holds_float_weight = False
    dequantize_on: torch.device | None = None

    def use_packed(self, layer: Linear, weight: PackedWeight) -> None:
        layer.packed, layer.torch_weight = weight, None
        layer.native = native_quant_linear(weight)

    def use_torch_ops(
        self,
        layer: Linear,
        codes: torch.Tensor,
        scales: torch.Tensor,
        offsets: torch.Tensor | None,
        bits: int,
    ) -> None:
        assert self.dequantize_on is not None
        layer.packed = None
        layer.torch_weight = TorchGroupedWeight.of(
            codes, scales, offsets, bits, self.dequantize_on, layer.dtype
        )

    def use_cpu_op(self, layer: Linear) -> None:
        """The layer runs `torch_apply` (torch's CPU op; its tensors set by the method)."""
        layer.packed = layer.torch_weight = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed is not None:
            return layer.native.forward(x, layer.bias, False)
        if layer.torch_weight is not None:
            return F.linear(x, layer.torch_weight.rows(None, x.dtype), layer.bias)
        return self.torch_apply(layer, x)

    def apply_float32(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed is not None:
            return layer.native.forward(x, layer.bias, True)
        return self.apply(layer, x).float()

    def torch_apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def native_linear(self, layer: Linear) -> Any | None:
        return layer.native if layer.packed is not None else None

    def dequantize_rows(self, layer: Linear, rows: torch.Tensor) -> torch.Tensor:
        """float32 rows `rows` of the weight (an embedding's lookup from a tied LM head)."""
        if layer.packed is not None:  # natively: packed_rows' ~20 torch ops cost ~0.8 ms a step
            return layer.native.rows(rows.long())
        if layer.torch_weight is not None:
            return layer.torch_weight.rows(rows, torch.float32)
        raise NotImplementedError(f"rows of torch's {self.weight_format} layout")
