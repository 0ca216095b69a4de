"""Weight-only int8 linears compute nn.Linear's product up to the quantization of their weight
(each row to 127 steps of its largest entry) and of their input (bfloat16), for a few rows;
more rows are the float layer's product itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.layers.int8_linear import MAX_INT8_ROWS, Int8Linear, int8_linear_available

pytestmark = pytest.mark.skipif(not int8_linear_available(), reason="no int8 kernel in this torch")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, MAX_INT8_ROWS])
def test_matches_nn_linear_up_to_quantization(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(256, 160, bias=bias)
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        expected = linear(x)
        got = Int8Linear.from_linear(linear)(x)
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
        assert torch.equal(Int8Linear.from_linear(linear)(x), linear(x))
