"""int8 linears compute nn.Linear's product up to the quantization of their weight (each row to
127 steps of its largest entry) and of their input (int8 per block of 32 with the native
kernels on a VNNI CPU, bfloat16 in torch's kernel); a draft's layer, which keeps its float
weight, gives more rows the float layer's product itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.kernels.int_linear import dequantize, kernel_reference, on_amx_tiles
from tokenmill.layers.linear import DenseLinearMethod, Linear
from tokenmill.quantization.int8 import (
    MAX_INT8_ROWS,
    Int8GroupWeight,
    Int8LinearMethod,
    int8_linear,
    int8_linear_available,
    quantize_int8,
)

pytestmark = pytest.mark.skipif(not int8_linear_available(), reason="no int8 kernel in this torch")


def draft_linear(linear: nn.Linear) -> Linear:
    return int8_linear(linear.weight, linear.bias, DenseLinearMethod())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, MAX_INT8_ROWS])
def test_matches_nn_linear_up_to_quantization(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(256, 160, bias=bias)
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        expected = linear(x)
        got = draft_linear(linear)(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    # Rounding each weight by at most half a step: |error| <= sum_i |x_i| * step / 2 per row.
    step = linear.weight.abs().amax(dim=1) / 127
    bound = 0.5 * x.abs() @ step[None].expand(256, -1) + 0.01 * expected.abs() + 1e-3
    assert ((got - expected).abs() <= bound).all()
    assert not torch.equal(got, expected)  # it is quantized, not a float32 product


@pytest.mark.parametrize("rows", [MAX_INT8_ROWS + 1, 300])
def test_many_rows_take_the_float_layer(rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(256, 160)
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        layer = draft_linear(linear)
        assert torch.equal(layer(x), linear(x))
        assert torch.equal(layer.forward_float32(x), linear(x))  # a draft's LM head: logits


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_without_a_fallback_every_row_count_is_the_dequantized_product(rows: int) -> None:
    """The target's int8 layers: any row count runs the int8 kernel, which equals the product
    with the dequantized weight up to bfloat16 rounding of the input and output."""
    torch.manual_seed(rows)
    weight = torch.randn(96, 128)
    layer = int8_linear(weight, None)
    x = torch.randn(rows, 128)
    if layer.packed is not None:  # the native kernel: its own reference, exactly
        reference = kernel_reference(x, layer.packed, None)
        tolerance = 1e-3 if on_amx_tiles(rows) else 1e-5  # AMX: float32 sums of bf16 products
        torch.testing.assert_close(layer(x), reference, rtol=tolerance, atol=100 * tolerance)
        assert torch.equal(dequantize(layer.packed), quantize_int8(weight).dequantize())
        return
    reference = x @ quantize_int8(weight).dequantize().T
    # bfloat16 keeps 8 bits: outputs of magnitude ~10 round by up to ~0.06.
    torch.testing.assert_close(layer(x), reference, rtol=2e-2, atol=0.1)


def test_loads_fused_parts_quantized_or_prequantized_alike() -> None:
    """Rows arriving as floats (online quantization) and as int8 + scales (a checkpoint's)
    end as the same layer."""
    torch.manual_seed(0)
    top, bottom = torch.randn(32, 64), torch.randn(16, 64)
    layers = []
    for prequantized in (False, True):
        layer = Linear(64, 48, Int8LinearMethod())
        for start, rows in ((0, top), (32, bottom)):
            part = quantize_int8(rows) if prequantized else rows
            layer.quant_method.load_weight(layer, part, start)
        layer.quant_method.process_weights_after_loading(layer)
        layers.append(layer)
    rows = torch.arange(48)
    got = [layer.quant_method.dequantize_rows(layer, rows) for layer in layers]
    assert torch.equal(got[0], got[1])
    expected = torch.cat([quantize_int8(top).dequantize(), quantize_int8(bottom).dequantize()])
    assert torch.equal(got[0], expected)
    assert isinstance(quantize_int8(top), Int8GroupWeight)
