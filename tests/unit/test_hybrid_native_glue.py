"""The hybrid layers' native glue against the same layers' torch ops (`TOKENMILL_FUSED_HYBRID=0`):
a gated DeltaNet layer's decode rows in one call (`gated_deltanet_decode`: outputs, conv and
recurrent states, at every ISA level, float32 and bfloat16, decode-only steps and decodes
beside a prompt chunk), and the residual add with the RMSNorm after it (`add_rms_norm`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tokenmill.kernels import gated_delta, native
from tokenmill.kernels.native import ISA_LEVELS, native_kernels
from tokenmill.layers.linear_state import LinearStateCache, LinearStateStep
from tokenmill.models.gated_deltanet import GatedDeltaNet, linear_state_spec
from tokenmill.models.hybrid import add_norm
from tokenmill.models.llama import RMSNorm

CONFIG = SimpleNamespace(
    hidden_size=48,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
)
SLOTS = 8

pytestmark = pytest.mark.skipif(
    native_kernels() is None or not hasattr(native_kernels(), "add_rms_norm"),
    reason="the native kernels do not build here",
)


def layer_and_cache(dtype: torch.dtype) -> tuple[GatedDeltaNet, LinearStateCache]:
    gen = torch.Generator().manual_seed(0)
    layer = GatedDeltaNet(CONFIG, 0, fused_projections=False)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=gen) * 0.3)
        layer.A_log.copy_(torch.rand(layer.A_log.shape, generator=gen))
    layer = layer.to(dtype)
    layer.after_loading()
    cache = LinearStateCache(linear_state_spec(CONFIG, 1, dtype), SLOTS, torch.device("cpu"))
    cache.conv[0].copy_(torch.randn(cache.conv[0].shape, generator=gen))
    cache.recurrent[0].copy_(torch.randn(cache.recurrent[0].shape, generator=gen) * 0.1)
    layer.states = cache
    return layer, cache


def run(
    dtype: torch.dtype, fused: bool, prompt: int, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.Tensor, ...]:
    """Three decode rows (slots 5, 0, 3), then a prompt chunk of `prompt` rows (slot 6)."""
    monkeypatch.setenv("TOKENMILL_FUSED_HYBRID", "1" if fused else "0")
    layer, cache = layer_and_cache(dtype)
    slots, decodes = [5, 0, 3], 3
    starts = [0, 1, 2, 3]
    if prompt:
        slots, starts = [*slots, 6], [*starts, 3 + prompt]
    cache.step = LinearStateStep(slots, starts, decodes, torch.tensor(slots[:decodes]))
    hidden = torch.randn(starts[-1], CONFIG.hidden_size, generator=torch.Generator().manual_seed(1))
    assert gated_delta.fused_decode_applies(hidden.to(dtype)) == fused
    with torch.no_grad():
        out = layer(hidden.to(dtype))
    return out.float(), cache.conv[0].float(), cache.recurrent[0]


@pytest.mark.parametrize("level", range(ISA_LEVELS.index("avx512") + 1), ids=ISA_LEVELS.__getitem__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("prompt", [0, 5])
def test_fused_decode_equals_torch_ops(
    level: int, dtype: torch.dtype, prompt: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    with native.using_isa(level):
        expected = run(dtype, False, prompt, monkeypatch)
        got = run(dtype, True, prompt, monkeypatch)
    # bfloat16: the torch path rounds where the kernel does (equal at the preset's widths too);
    # an ulp apart at most where the sums' orders differ.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_equals_torch_ops(
    dtype: torch.dtype, offset: float, with_delta: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(3)
    norm = RMSNorm(96, 1e-6, offset)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen) * 0.5)
    norm = norm.to(dtype)
    hidden = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    delta = (torch.randn(7, 96, generator=gen) * 3).to(dtype) if with_delta else None
    results = []
    for switch in ("0", "1"):
        monkeypatch.setenv("TOKENMILL_FUSED_HYBRID", switch)
        with torch.no_grad():
            results.append(add_norm(hidden, delta, norm))
    (sum_torch, normed_torch), (sum_native, normed_native) = results
    assert torch.equal(sum_native, sum_torch)  # the add rounds as torch's
    if dtype == torch.bfloat16:  # rounded once, after the scale, as F.rms_norm
        assert torch.equal(normed_native, normed_torch)
    else:
        torch.testing.assert_close(normed_native, normed_torch, atol=1e-5, rtol=1e-5)
