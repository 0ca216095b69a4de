"""Tensor parallelism on the CPU (gloo, two ranks): greedy outputs identical to one rank for the
whole family through chunked prefill, preemption, prefix hits and n-gram speculation; each rank
holds half the weights. Failures and shutdown: test_tensor_parallel_failures.py."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.models.weight_bytes import weight_bytes

# Each checkpoint also exercises one sharding corner.
ARCHITECTURES: dict[str, dict] = {
    "llama": {"vocab_size": 1021},  # the vocabulary splits unevenly: the last rank pads
    "mistral": {"num_key_value_heads": 1},  # more ranks than KV heads: the head is replicated
    "qwen2": {"tie_word_embeddings": True},  # q/k/v biases; a tied vocab-parallel LM head
    "qwen3": {"seed": 2},  # per-head q/k norms (seed 2: its outputs repeat, so n-grams draft)
}
ENGINE = {
    "dtype": "float32",
    "max_model_len": 64,
    "block_size": 4,
    "max_num_batched_tokens": 12,  # prompts are chunked
    "num_kv_blocks": 16,  # room for one request at a time: preemption
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    phrase = [rng.randrange(10, 1000) for _ in range(9)]
    return [phrase * 4, [rng.randrange(10, 1000) for _ in range(30)], [*phrase * 2, 11, 12]]


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy and one seeded sample, in two waves so the second hits the prefix cache."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    first = llm.generate(prompts[:2], greedy, use_tqdm=False)
    second = llm.generate(
        [*prompts, prompts[1]], [greedy] * len(prompts) + [seeded], use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in first + second]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def engines(request, tiny_checkpoint) -> Iterator[tuple[LLM, LLM]]:
    """(one rank, two ranks) per architecture, shared by its tests. One tensor-parallel
    engine per process: pytest ends an architecture's before it starts the next."""
    checkpoint = str(tiny_checkpoint(request.param, **ARCHITECTURES[request.param]))
    single = LLM(checkpoint, **ENGINE)
    sharded = LLM(checkpoint, tensor_parallel_size=2, **ENGINE)
    yield single, sharded
    sharded.engine.shutdown()


def test_two_ranks_generate_what_one_rank_does(engines, prompts) -> None:
    single, sharded = engines
    assert generate(sharded, prompts) == generate(single, prompts)
    stats = sharded.get_stats().scheduler
    assert stats.num_preemptions > 0
    assert stats.prefix_cache.hits > 0
    assert stats.spec_decode is not None and stats.spec_decode.num_draft_tokens > 0


def test_each_rank_loads_half_the_weights(engines) -> None:
    single, sharded = engines
    whole = weight_bytes(single.engine.runner.model)
    per_rank = sharded.engine.parts.executor.weight_bytes
    assert per_rank[0] == weight_bytes(sharded.engine.runner.model)
    # Norms (and mistral's single KV head) are replicated: a little over half.
    assert len(per_rank) == 2 and all(0.5 <= b / whole < 0.56 for b in per_rank), per_rank
