"""The gated delta rule (layers/gated_delta_rule.py): the chunked form equals the recurrent one
and transformers' torch references, a state carried across chunks equals one pass; the native
decode and prefill kernels (kernels/gated_delta.py) equal the torch references at every ISA
level."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from tokenmill.kernels import gated_delta, native
from tokenmill.kernels.native import ISA_LEVELS, native_kernels
from tokenmill.layers.gated_delta_rule import (
    chunked_delta_rule,
    normalize_qk,
    recurrent_delta_rule,
)

K_HEADS, V_HEADS, K_DIM, V_DIM = 2, 4, 16, 32


def inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, K_HEADS, K_DIM, generator=gen)
    k = torch.randn(tokens, K_HEADS, K_DIM, generator=gen)
    v = torch.randn(tokens, V_HEADS, V_DIM, generator=gen)
    decay = -torch.rand(tokens, V_HEADS, generator=gen)  # log space, <= 0
    beta = torch.rand(tokens, V_HEADS, generator=gen)
    return q, k, v, decay, beta


@pytest.mark.parametrize("tokens", [1, 5, 64, 150])
def test_chunked_equals_recurrent_and_transformers(tokens: int) -> None:
    q, k, v, decay, beta = inputs(tokens)
    start = torch.randn(V_HEADS, K_DIM, V_DIM, generator=torch.Generator().manual_seed(9))
    nq, nk = normalize_qk(q, k, V_HEADS)
    chunked_state, recurrent_state = start.clone(), start.clone()
    chunked = chunked_delta_rule(nq, nk, v, decay, beta, chunked_state)
    recurrent = recurrent_delta_rule(nq, nk, v, decay, beta, recurrent_state)
    torch.testing.assert_close(chunked, recurrent, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunked_state, recurrent_state, atol=1e-4, rtol=1e-4)
    for reference in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        out, state = reference(
            q[None], k[None], v[None], g=decay[None], beta=beta[None],
            initial_state=start[None].clone(), output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(chunked, out[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(chunked_state, state[0], atol=1e-4, rtol=1e-4)


def test_state_carried_across_prefill_chunks() -> None:
    """A prompt in chunks of 7 (the engine's chunked prefill) equals one pass."""
    q, k, v, decay, beta = inputs(30, seed=1)
    nq, nk = normalize_qk(q, k, V_HEADS)
    whole_state = torch.zeros(V_HEADS, K_DIM, V_DIM)
    whole = chunked_delta_rule(nq, nk, v, decay, beta, whole_state)
    state = torch.zeros(V_HEADS, K_DIM, V_DIM)
    parts = [
        chunked_delta_rule(nq[s : s + 7], nk[s : s + 7], v[s : s + 7], decay[s : s + 7],
                           beta[s : s + 7], state)
        for s in range(0, 30, 7)
    ]  # fmt: skip
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, whole_state, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(native_kernels() is None, reason="the native kernels do not build here")
@pytest.mark.parametrize("level", range(ISA_LEVELS.index("avx512") + 1), ids=ISA_LEVELS.__getitem__)
@pytest.mark.parametrize("v_dim", [V_DIM, 12])  # 12: the portable loop at every level
def test_native_decode_equals_torch(level: int, v_dim: int) -> None:
    rows, slots = 5, torch.tensor([3, 0, 6, 1, 4])
    q, k, _, decay, beta = inputs(rows, seed=2)
    v = torch.randn(rows, V_HEADS, v_dim)
    pool = torch.randn(8, V_HEADS, K_DIM, v_dim)
    expected_pool = pool.clone()
    expected = gated_delta.decode_delta_rule_torch_(q, k, v, decay, beta, expected_pool, slots)
    with native.using_isa(level):
        assert gated_delta.native_applies(q, pool)
        out = gated_delta.decode_delta_rule_(q, k, v, decay, beta, pool, slots)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, expected_pool, atol=1e-5, rtol=1e-5)  # others untouched


@pytest.mark.skipif(native_kernels() is None, reason="the native kernels do not build here")
@pytest.mark.parametrize("level", range(ISA_LEVELS.index("avx512") + 1), ids=ISA_LEVELS.__getitem__)
@pytest.mark.parametrize("v_dim", [V_DIM, 12])  # 12: the portable loop at every level
def test_native_prefill_equals_recurrent(level: int, v_dim: int) -> None:
    tokens = 70
    q, k, _, decay, beta = inputs(tokens, seed=4)
    v = torch.randn(tokens, V_HEADS, v_dim)
    state = torch.randn(V_HEADS, K_DIM, v_dim)
    expected_state = state.clone()
    expected = recurrent_delta_rule(*normalize_qk(q, k, V_HEADS), v, decay, beta, expected_state)
    with native.using_isa(level):
        assert gated_delta.native_prefill_applies(q, state)
        out = gated_delta.prefill_delta_rule_(q[:30], k[:30], v[:30], decay[:30], beta[:30], state)
        rest = gated_delta.prefill_delta_rule_(q[30:], k[30:], v[30:], decay[30:], beta[30:], state)
    torch.testing.assert_close(torch.cat([out, rest]), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, expected_state, atol=1e-4, rtol=1e-4)
