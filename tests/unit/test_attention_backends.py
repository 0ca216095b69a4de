"""Attention backends against the portable reference (`TorchPagedAttention`).

The Triton kernel runs natively where CUDA is, and on CPU tensors under Triton's interpreter
elsewhere (slow: the shapes here are tiny). `pytest -m cuda` runs the larger CUDA cases.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from tokenmill.config import ConfigError
from tokenmill.layers.attention.selector import resolve_attention_backend
from tokenmill.layers.attention.torch_backend import TorchPagedAttention
from tokenmill.layers.attention.triton_backend import TritonPagedAttention
from tokenmill.layers.parallel import SINGLE
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.step.layout import layout_step, query_length_class

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.cuda  # natively on a GPU under `pytest -m cuda`
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run_both(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    sliding_window: int | None = None,
    seed: int = 0,
    backend: type = TritonPagedAttention,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of sequences with these new tokens over these cached contexts, through the
    reference and `backend` on identical caches with blocks scattered at random; returns
    (reference output, backend output)."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    order = sorted(range(len(query_lens)), key=lambda i: query_length_class(query_lens[i]))
    q_lens = np.array([query_lens[i] for i in order], dtype=np.int64)
    seq_lens = q_lens + np.array([context_lens[i] for i in order], dtype=np.int64)
    blocks_needed = -(-seq_lens // block_size)
    num_blocks = int(blocks_needed.sum()) + 3
    ids = rng.permutation(num_blocks)
    block_ids, used = [], 0
    for n in blocks_needed:
        block_ids.append(ids[used : used + n].tolist())
        used += int(n)
    _, metadata = layout_step(block_ids, q_lens, seq_lens, block_size, sliding_window, DEVICE)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(cache_dtype or dtype).to(DEVICE)
    num_tokens = int(q_lens.sum())
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    scale = head_dim**-0.5
    reference = TorchPagedAttention(num_heads, num_kv_heads, head_dim, scale)
    tested = backend(num_heads, num_kv_heads, head_dim, scale)
    expected = reference.forward(query, kv, cache.clone(), metadata)
    actual = tested.forward(query, kv, cache.clone(), metadata)
    return expected, actual


def test_decodes_of_different_lengths_with_gqa_match_the_reference() -> None:
    expected, actual = run_both(query_lens=[1, 1, 1], context_lens=[0, 6, 13])
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_chunks_over_cached_context_mixed_with_decodes_match_the_reference() -> None:
    # a decode, a short chunk (draft-verification sized) and a long chunk over 5 cached tokens
    # with an odd block count; 3 query heads per KV head (not a power of two).
    expected, actual = run_both(
        query_lens=[1, 3, 19], context_lens=[9, 0, 5], num_heads=6, num_kv_heads=2, head_dim=8
    )
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_sliding_window_and_a_block_size_of_3_match_the_reference() -> None:
    expected, actual = run_both(
        query_lens=[1, 18], context_lens=[40, 7], sliding_window=8, block_size=3
    )
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_decode_is_close_to_the_reference(dtype: torch.dtype) -> None:
    expected, actual = run_both(query_lens=[1, 1], context_lens=[3, 11], dtype=dtype)
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_fp8_cache_matches_the_reference() -> None:
    expected, actual = run_both(
        query_lens=[1, 5], context_lens=[7, 2], cache_dtype=torch.float8_e4m3fn
    )
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_auto_picks_triton_only_on_cuda() -> None:
    assert resolve_attention_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_attention_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_attention_backend("torch", torch.device("cuda")) == "torch"
    with pytest.raises(ConfigError, match="unknown attention backend"):
        resolve_attention_backend("flash", torch.device("cpu"))


def test_the_model_is_built_with_the_backend_asked_for_in_every_layer() -> None:
    hf_config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=100,
    )
    model = LlamaForCausalLM(hf_config, "LlamaForCausalLM", torch.float32, SINGLE, "triton")
    for layer in model.layers:
        attn = layer.self_attn.attn
        assert isinstance(attn, TritonPagedAttention)
        assert (attn.num_heads, attn.num_kv_heads, attn.scale) == (4, 2, 16**-0.5)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_llama_1b_shaped_batch_matches_the_reference(dtype: torch.dtype) -> None:
    """32 heads / 8 KV heads, head_dim 64, block 16: 24 decodes of lengths up to 900 and two
    prefill chunks over cached contexts, as one step."""
    rng = np.random.default_rng(1)
    query_lens = [1] * 24 + [300, 77]
    context_lens = [*rng.integers(1, 900, size=24).tolist(), 0, 513]
    expected, actual = run_both(
        query_lens, context_lens, 32, 8, 64, block_size=16, dtype=dtype, seed=1
    )
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)
