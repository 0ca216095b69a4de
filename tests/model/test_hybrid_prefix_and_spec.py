"""Hybrid models (Qwen3.5) with prefix caching and n-gram speculation: greedy tokens equal to
transformers fp32 with chunked prefill, preemption, prefix hits (the linear layers' states
restored from snapshots at block boundaries) and drafts verified (rejected ones rolled back
out of the states) in one batch; snapshots dropped with their blocks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill_testing.transformers_reference import greedy_reference

MAX_TOKENS = 10
LINEAR = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_hidden_layers": 4,  # three linear layers, then one full attention
    "head_dim": 16,
}
ENGINE = {
    "dtype": "float32",
    "max_model_len": 64,
    "block_size": 4,
    "num_kv_blocks": 22,  # too few for every sequence at once: preemptions
    "max_num_batched_tokens": 9,  # prompts in chunks
    "max_num_seqs": 4,
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3_5", **LINEAR)


@pytest.fixture(scope="module")
def prompts_and_expected(checkpoint: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts sharing prefixes of 0-6 blocks (some ending inside a block, one a repeat), and
    two that echo a prompt and the start of its greedy reply, then the prompt again (n-gram
    drafts: the earlier reply, its first tokens accepted, later ones not); transformers'
    greedy tokens for them."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rng = random.Random(3)
    vocab = model.config.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(24)]
    phrase = [rng.randrange(3, vocab) for _ in range(3)]
    prompts = [
        shared + phrase * 3,
        shared[:13] + phrase * 4,
        shared[:6] + [rng.randrange(3, vocab) for _ in range(9)],
        shared + phrase * 3,
        [rng.randrange(3, vocab) for _ in range(5)],
        shared[:17] + phrase * 2,
        shared[:9],
        [rng.randrange(3, vocab) for _ in range(20)],
    ]
    expected, _ = greedy_reference(model, prompts, MAX_TOKENS)
    echoes = [prompts[i] + expected[i][:4] + prompts[i] for i in (2, 7)]
    echoed, _ = greedy_reference(model, echoes, MAX_TOKENS)
    return prompts + echoes, expected + echoed


def greedy() -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True
    )


def test_prefix_hits_restore_snapshots(checkpoint: Path, prompts_and_expected) -> None:
    prompts, expected = prompts_and_expected
    llm = LLM(model=str(checkpoint), **ENGINE)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    parts = llm.engine.parts
    assert parts.kv_cache_manager.prefix_cache_stats.hits > 0
    assert llm.get_stats().scheduler.num_preemptions > 0
    # Again, every prompt's prefix now cached: still the same tokens.
    again = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
    snapshots = parts.runner.linear_states.snapshots
    assert snapshots is not None and 0 < len(snapshots) <= snapshots.num_slots


def test_ngram_speculation_rolls_states_back(checkpoint: Path, prompts_and_expected) -> None:
    prompts, expected = prompts_and_expected
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model=str(checkpoint), speculative_config=spec, **ENGINE)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.get_stats().scheduler.spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # some drafts rolled back
    assert llm.engine.parts.kv_cache_manager.prefix_cache_stats.hits > 0
