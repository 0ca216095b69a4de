"""The dense linear methods: oneDNN-reordered and natively packed weights compute what
nn.Linear computes, and replace every one; a tied weight stays shared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tokenmill.kernels.native import native_kernels
from tokenmill.layers.linear import (
    DenseLinearMethod,
    Linear,
    OneDNNLinearMethod,
    PackedLinearMethod,
    cpu_dense_method,
    onednn_linear_available,
    padded_rows,
    replace_linears,
    use_fast_cpu_linears,
)


def onednn_linear(linear: nn.Linear) -> Linear:
    layer = Linear.from_module(linear, OneDNNLinearMethod())
    layer.quant_method.process_weights_after_loading(layer)
    return layer


pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="no oneDNN in this torch")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 3, 5, 17, 300])
def test_matches_nn_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        expected = linear(x)
        got = onednn_linear(linear)(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("rows", [2, 37])
def test_fused_gelu_unpadded_matches_linear_then_gelu(approximate: str, rows: int) -> None:
    """The encoder's MLP product: bias and GELU fused, rows not padded (2 rows: F.linear)."""
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160)
    x = torch.randn(rows, 96)
    layer = Linear.from_module(linear, OneDNNLinearMethod(pad_rows=False))
    layer.quant_method.process_weights_after_loading(layer)
    with torch.inference_mode():
        expected = torch.nn.functional.gelu(linear(x), approximate=approximate)
        got = layer.quant_method.apply_then(layer, x, "gelu", approximate)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(native_kernels() is None, reason="native kernels not buildable here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 5, 300])
def test_packed_method_matches_nn_linear_and_keeps_one_layout(
    dtype: torch.dtype, rows: int
) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160).to(dtype)
    plain = linear.weight.detach().clone()
    x = torch.randn(rows, 96).to(dtype)
    with torch.inference_mode():
        expected = linear(x).float()
        layer = Linear.from_module(linear, PackedLinearMethod(dtype))
        layer.quant_method.process_weights_after_loading(layer)
        got = layer(x)
    assert layer.weight is None  # the packed copy is the only one
    assert torch.equal(PackedLinearMethod.plain_weight(layer), plain)
    assert got.dtype == dtype and got.shape == expected.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)


def test_the_cpu_default_is_packed_where_the_native_kernels_build() -> None:
    method = cpu_dense_method(torch.bfloat16)
    expected = PackedLinearMethod if native_kernels() is not None else OneDNNLinearMethod
    assert isinstance(method, expected)


def test_every_linear_is_replaced_and_the_output_kept() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        expected = model(x)
        assert use_fast_cpu_linears(model) == 2
        got = model(x)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_dense_method_keeps_a_tied_weight_shared() -> None:
    embedding = nn.Embedding(32, 8)
    model = nn.ModuleDict({"embed": embedding, "head": nn.Linear(8, 32, bias=False)})
    model["head"].weight = embedding.weight
    layers = replace_linears(model, lambda name, linear: DenseLinearMethod())
    assert layers["head"].weight is embedding.weight
    x = torch.randn(2, 8)
    torch.testing.assert_close(model["head"](x), x @ embedding.weight.T)


def test_padded_row_counts_are_few_and_waste_little() -> None:
    sizes = {padded_rows(n) for n in range(1, 2049)}
    assert len(sizes) <= 72
    assert all(n <= padded_rows(n) <= max(8, n * 1.125) for n in range(1, 5000))


_RSS_PROBE = """
import torch
from torch import nn
from tokenmill.layers.linear import Linear, OneDNNLinearMethod

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

layers = [Linear.from_module(nn.Linear(576, 1536), OneDNNLinearMethod()),
          Linear.from_module(nn.Linear(1536, 576), OneDNNLinearMethod())]
for layer in layers:
    layer.quant_method.process_weights_after_loading(layer)
start = rss_mb()
with torch.inference_mode():
    for rows in range(2, 150):
        for layer in layers:
            layer(torch.randn(rows, layer.in_features))
print(rss_mb() - start)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_resident_memory_stays_bounded_across_many_row_counts() -> None:
    """Every row count from 2 to 149 through two weights: unpadded, oneDNN cached a primitive
    per shape (0.7 MB each) and the process grew by ~200 MB; padded, ~50 MB."""
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    probe = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE], capture_output=True, text=True, env=env, check=True
    )
    growth_mb = float(probe.stdout.split()[-1])
    assert growth_mb < 100, f"RSS grew {growth_mb:.0f} MB"
