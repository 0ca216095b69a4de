"""Linear layers: one `Linear` module, and one `LinearMethod` per layer that decides how its
weight is stored and multiplied (vLLM's `LinearMethodBase`).

A method is chosen once, at load time, for each layer (`quantization/selection.py`: from the
weight format, the device and the dtype); the model calls `layer(x)`, which is the method's
`apply`, and the loader fills the weight through `load_weight`. The methods here are the
dense ones: `DenseLinearMethod` (`F.linear`), `PackedLinearMethod` (the native kernels' packed
layout, the CPU default where they build) and `OneDNNLinearMethod` (below, the CPU default
where they do not); the quantized ones are in `quantization/`, one module a weight format
(`int8.py`, `int4.py`).

OneDNN: `F.linear` on float32 CPU tensors goes to a BLAS whose kernels here (AMD Zen 5,
AVX-512) reached 200 GFLOP/s at 2048 rows and far less at a few rows (5 rows of a 1536 x 256
weight: 68 us, vs 25 us for one row). oneDNN with the weight reordered into its blocked layout
ran the same products 2.2-3x faster at every row count from 5 to 2048; at one row it wins for
large weights only (below). The reorder is what `torch.compile` with freezing does to a CPU
model; doing it at load time needs no compiler. Outputs agree with `F.linear` to float32
rounding (different summation order).

Row counts are padded up to a few sizes (`padded_rows`). oneDNN JIT-compiles a primitive per
input shape and two caches keep them (ideep's and oneDNN's, 1024 entries each): with every
row count a new shape, a server's resident memory grew by ~750 MB over its first few thousand
requests (0.6-1 MB per primitive) before the caches filled, and each new shape paid its
compilation inside a step. Padding bounds both: 72 shapes per weight up to 2048 rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.linear import (
    native_dense_linear,
    pack_linear_weight,
    packed_linear,
    packed_linear_available,
    unpack_linear_weight,
)

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


class LinearMethod:
    """How one linear layer holds and multiplies its weight. Subclasses set `weight_format`
    (what the start-up log and /v1/models report, e.g. "float32", "int8", "int4-g32")."""

    weight_format: str = "?"
    # Whether the layer holds a float `weight` parameter (dense methods) or its own storage.
    holds_float_weight: bool = True

    def create_weights(self, layer: Linear, weight: nn.Parameter | None) -> None:
        """Make the layer's weight storage; `weight`, when given, is an existing float
        parameter to hold (a tied LM head shares the embedding's)."""
        layer.weight = weight if weight is not None else nn.Parameter(layer.empty_weight())

    def load_weight(self, layer: Linear, loaded: object, row_start: int) -> None:
        """Copy checkpoint rows `[row_start, row_start + rows)` of the weight into the layer
        (a fused layer's part: q, k, v or gate, up)."""
        if not isinstance(loaded, torch.Tensor) and hasattr(loaded, "dequantize"):
            loaded = loaded.dequantize()  # a quantized checkpoint's weight for a float layer
        if not isinstance(loaded, torch.Tensor):
            raise TypeError(f"a {self.weight_format} linear takes float weights, not {loaded}")
        destination = layer.weight.data.narrow(0, row_start, loaded.shape[0])
        check_shape(loaded.shape, destination.shape)
        destination.copy_(loaded)

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Convert the loaded weight into the layout `apply` multiplies with."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_float32(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """`apply` with a float32 result (the logits), where a method can skip the rounding."""
        return self.apply(layer, x).float()

    def native_linear(self, layer: Linear) -> Any | None:
        """The layer's weight as the fused decoder stack multiplies it (a native
        `PackedLinear`: dense packed, int8 or int4), or None where the stack cannot (the
        model then runs op by op). Asked once, after loading."""
        return None


class WeightShapeError(ValueError):
    """A checkpoint tensor's shape disagrees with the layer it is loaded into."""


def check_shape(got: torch.Size | tuple[int, ...], expected: torch.Size | tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise WeightShapeError(f"shape {tuple(got)}, the model expects {tuple(expected)}")


class DenseLinearMethod(LinearMethod):
    """The weight in the model's dtype, multiplied by `F.linear`."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.weight_format = str(dtype).removeprefix("torch.")

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class PackedLinearMethod(DenseLinearMethod):
    """float32 or bfloat16 on the CPU in the native kernels' packed layout (kernels/linear.py):
    one copy of the weight serves every row count (few-row GEMV at the memory roof, AMX or
    AVX-512 tiles above). After loading, `layer.weight` is None (a tied LM head's weight lives
    on in the embedding) and `layer.packed_weight` holds the packed copy; the fused decoder
    stack (kernels/decoder_stack.py) reads it too."""

    def process_weights_after_loading(self, layer: Linear) -> None:
        layer.packed_weight = pack_linear_weight(layer.weight.to(layer.dtype))
        layer.weight = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, layer.packed_weight, layer.out_features, layer.bias)

    def apply_float32(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, layer.packed_weight, layer.out_features, layer.bias, float32=True)

    def native_linear(self, layer: Linear) -> Any | None:
        return native_dense_linear(layer.packed_weight, layer.out_features, layer.in_features)

    @staticmethod
    def plain_weight(layer: Linear) -> torch.Tensor:
        """The `[out_features, in_features]` weight back from its packed copy."""
        return unpack_linear_weight(layer.packed_weight, layer.out_features, layer.in_features)


class OneDNNLinearMethod(DenseLinearMethod):
    """float32 or bfloat16 on the CPU with the weight reordered for oneDNN (module docstring),
    where the native kernels are not built, and a float32 encoder's (pooling/model_loading.py).
    A small weight is kept in torch's layout too, for products of a few rows; a large one is
    dropped after the reorder (`layer.weight` is then None). `pad_rows`: products' rows padded
    to few shapes (`padded_rows`), so a decoder's steps reuse oneDNN's primitives; an
    encoder's steps (thousands of rows, each step its own count) skip the padding copy, which
    cost more than a new primitive."""

    def __init__(self, dtype: torch.dtype = torch.float32, pad_rows: bool = True) -> None:
        super().__init__(dtype)
        self.pad_rows = pad_rows

    def process_weights_after_loading(self, layer: Linear) -> None:
        weight = layer.weight.detach()
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)
        layer.few_rows_by_f_linear = weight.numel() < _SMALL_WEIGHT_ELEMENTS
        if not layer.few_rows_by_f_linear:
            layer.weight = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.apply_then(layer, x, "none", "")

    def apply_then(self, layer: Linear, x: torch.Tensor, op: str, algorithm: str) -> torch.Tensor:
        """The product with oneDNN's pointwise `op` fused after the bias ("none", or "gelu"
        with `algorithm` "none" (erf) or "tanh": one pass over the output, not two)."""
        num_rows = x.shape[0]
        if layer.few_rows_by_f_linear and num_rows <= _SMALL_WEIGHT_ROWS:
            out = F.linear(x, layer.weight, layer.bias)
            return out if op == "none" else F.gelu(out, approximate=algorithm)
        padding = padded_rows(num_rows) - num_rows if self.pad_rows else 0
        if padding:
            x = F.pad(x, (0, 0, 0, padding))
        out = torch.ops.mkldnn._linear_pointwise(
            x, layer.packed_weight, layer.bias, op, [], algorithm
        )
        return out[:num_rows] if padding else out


class Linear(nn.Module):
    """`y = x W^T + b`, W stored and multiplied as `quant_method` decides. `bias` stays a float
    parameter (loaded as any other); the weight's storage belongs to the method."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        quant_method: LinearMethod,
        bias: nn.Parameter | None = None,
        weight: nn.Parameter | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype
        self.quant_method = quant_method
        self.bias = bias
        quant_method.create_weights(self, weight)

    @classmethod
    def from_module(cls, linear: nn.Linear, quant_method: LinearMethod) -> Linear:
        """A `Linear` in place of `linear`, keeping its bias parameter (and its weight, for a
        dense method: a tied weight stays tied)."""
        dense = quant_method.holds_float_weight
        return cls(
            linear.in_features,
            linear.out_features,
            quant_method,
            bias=linear.bias,
            weight=linear.weight if dense else None,
            dtype=linear.weight.dtype,
        )

    def empty_weight(self) -> torch.Tensor:
        return torch.empty(self.out_features, self.in_features, dtype=self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply_float32(self, x)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{type(self.quant_method).__name__} ({self.quant_method.weight_format})"
        )


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


# (the layer's name in the model, the float layer it replaces) -> its method
MethodChooser = Callable[[str, nn.Linear], LinearMethod]


def replace_linears(model: nn.Module, choose: MethodChooser) -> dict[str, Linear]:
    """Replace every `nn.Linear` of `model` by a `Linear` whose method `choose(name, linear)`
    picks (before or after the weights load: a dense method keeps the loaded weight). Returns
    the new layers by name."""
    replaced: dict[str, Linear] = {}
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                full_name = f"{parent_name}.{name}" if parent_name else name
                layer = Linear.from_module(child, choose(full_name, child))
                setattr(parent, name, layer)
                replaced[full_name] = layer
    return replaced


def process_linears_after_loading(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.quant_method.process_weights_after_loading(module)


def cpu_dense_method(dtype: torch.dtype) -> LinearMethod | None:
    """The fastest dense method for a CPU linear of `dtype`: the native packed layout where
    the kernels build, else oneDNN's; None where neither runs that dtype."""
    if packed_linear_available(dtype, torch.device("cpu")):
        return PackedLinearMethod(dtype)
    if dtype in (torch.float32, torch.bfloat16) and onednn_linear_available():
        return OneDNNLinearMethod(dtype)
    return None


def use_fast_cpu_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` (its weights loaded) by a `Linear` of
    `cpu_dense_method`; returns how many. For float32 models on the CPU."""
    if cpu_dense_method(torch.float32) is None:
        return 0
    layers = replace_linears(
        model, lambda name, linear: cpu_dense_method(linear.weight.dtype) or DenseLinearMethod()
    )
    for layer in layers.values():
        layer.quant_method.process_weights_after_loading(layer)
    return len(layers)
