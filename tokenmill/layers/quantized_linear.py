"""What the int8 and int4 linear methods share where the native kernels run them: the layer
holds its weight packed (`layer.packed`, kernels/quant.py) and the native `PackedLinear` over
it (`layer.native`), which its products call and the fused decoder stack multiplies. Without
the native kernels (`layer.packed` None) each method runs torch's own op (`torch_apply`)."""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.kernels.quant import PackedWeight, native_quant_linear, packed_rows
from tokenmill.layers.linear import Linear, LinearMethod


class PackedQuantMethod(LinearMethod):
    holds_float_weight = False

    @staticmethod
    def use_packed(layer: Linear, weight: PackedWeight) -> None:
        layer.packed = weight
        layer.native = native_quant_linear(weight)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed is None:
            return self.torch_apply(layer, x)
        return layer.native.forward(x, layer.bias, False)

    def apply_float32(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if layer.packed is None:
            return self.torch_apply(layer, x).float()
        return layer.native.forward(x, layer.bias, True)

    def torch_apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def native_linear(self, layer: Linear) -> Any | None:
        return layer.native if layer.packed is not None else None

    def dequantize_rows(self, layer: Linear, rows: torch.Tensor) -> torch.Tensor:
        """float32 rows `rows` of the weight (an embedding's lookup from a tied LM head)."""
        if layer.packed is None:
            raise NotImplementedError(f"rows of torch's {self.weight_format} layout")
        return packed_rows(layer.packed, rows)
