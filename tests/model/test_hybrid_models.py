"""Qwen3.5 and Qwen3-Next (hybrid gated DeltaNet + gated attention, models/hybrid.py) against
transformers: greedy tokens equal in float32 with chunked prefill and preemption in one batch;
the state cache's slots and memory; what is refused, one line each."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError
from tokenmill_testing.transformers_reference import greedy_reference

MAX_TOKENS = 8
LINEAR = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_hidden_layers": 4,  # three linear layers, then one full attention
    "head_dim": 16,
}
FAMILIES = {
    "qwen3_5": LINEAR,
    # MoE layers (a shared expert with its gate) but layer 1, dense by mlp_only_layers.
    "qwen3_next": {
        **LINEAR,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "mlp_only_layers": [1],
    },
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tiny_checkpoint) -> Path:
    return tiny_checkpoint(request.param, **FAMILIES[request.param])


def greedy() -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True
    )


def test_greedy_equals_transformers_chunked_and_preempted(checkpoint: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rng = random.Random(1)
    vocab = model.config.vocab_size
    # Longer than a 64-token chunk of the chunked form; one token; a few.
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (70, 1, 5, 20, 33)]
    expected, _ = greedy_reference(model, prompts, MAX_TOKENS)
    llm = LLM(
        model=str(checkpoint),
        dtype="float32",
        max_model_len=96,
        block_size=4,
        num_kv_blocks=26,  # too few for every sequence at once: preemptions
        max_num_batched_tokens=7,  # prompts in chunks of up to 7 tokens
        max_num_seqs=4,
    )
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.get_stats().scheduler.num_preemptions > 0
    parts = llm.engine.parts
    states = parts.runner.linear_states
    # Slots are given back as the runner hears of finishes: at the next step (the last one's
    # finish has no next step here).
    assert states is not None and states.num_free + len(states.slot_of) == 4
    assert len(states.slot_of) <= 1


def test_state_memory_comes_out_of_the_kv_budget(tiny_checkpoint) -> None:
    checkpoint = tiny_checkpoint("qwen3_5", **LINEAR)
    budget = 4 << 20
    few = LLM(model=str(checkpoint), dtype="float32", kv_cache_memory=budget, max_num_seqs=2)
    many = LLM(model=str(checkpoint), dtype="float32", kv_cache_memory=budget, max_num_seqs=64)
    spec = few.engine.runner.model.state_spec
    assert spec.bytes_per_slot == 3 * (4 * 4 * 16 * 16 + 3 * (2 * 32 + 64) * 4)
    assert (
        few.engine.parts.kv_cache_manager.num_blocks > many.engine.parts.kv_cache_manager.num_blocks
    )


@pytest.mark.parametrize(
    ("settings", "feature"),
    [
        ({"speculative_config": {"method": "suffix", "num_speculative_tokens": 2}}, "speculative"),
        ({"preemption_mode": "swap"}, "swap"),
        ({"enable_lora": True}, "LoRA"),
        ({"enforce_eager": False}, "captured decode"),
    ],
)
def test_unsupported_features_are_refused(tiny_checkpoint, settings, feature: str) -> None:
    checkpoint = tiny_checkpoint("qwen3_5", **LINEAR)
    with pytest.raises(ConfigError, match=f"Qwen3_5ForCausalLM.*{feature}"):
        LLM(model=str(checkpoint), dtype="float32", **settings)
