"""oneDNN-reordered linear layers compute what nn.Linear computes, and replace every one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.layers.linear import OneDNNLinear, onednn_linear_available, use_onednn_linears

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="no oneDNN in this torch")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 5, 17, 300])
def test_matches_nn_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        expected = linear(x)
        got = OneDNNLinear(linear)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_every_linear_is_replaced_and_the_output_kept() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        expected = model(x)
        assert use_onednn_linears(model) == 2
        got = model(x)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
