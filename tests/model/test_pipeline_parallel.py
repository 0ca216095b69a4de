"""Pipeline parallelism on the CPU (gloo): two stages, and two stages of two tensor-parallel
ranks each, give one process's greedy tokens and logprobs through chunked prefill, preemption
(by recompute, or by swap) and prefix hits, most steps in two micro-batches; each stage loads
only its own part of the weights. Refusals: tests/unit/test_pipeline_parallel_config.py."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.models.weight_bytes import weight_bytes

ENGINE = {
    "dtype": "float32",
    "max_model_len": 64,
    "block_size": 4,
    "max_num_batched_tokens": 12,  # prompts are chunked
    "num_kv_blocks": 16,  # room for one request at a time: preemption
}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    # Three layers: the stages split unevenly (2 + 1); the vocabulary splits unevenly over
    # two tensor-parallel ranks.
    return tiny_checkpoint("llama", num_hidden_layers=3, vocab_size=1021)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    phrase = [rng.randrange(10, 1000) for _ in range(9)]
    other = [rng.randrange(10, 1000) for _ in range(14)]
    return [phrase * 2, other, [*phrase, 11, 12], phrase[:5]]


def generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list | None]]:
    """Greedy, in two waves so the second hits the prefix cache; one request of the second
    asks for logprobs (its steps run in one piece)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    first = llm.generate(prompts[:2], greedy, use_tqdm=False)
    params = [greedy, with_logprobs, *[greedy] * (len(prompts) - 2)]
    second = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, rounded(o.outputs[0].logprobs)) for o in first + second]


def rounded(logprobs: list | None) -> list | None:
    """To 4 decimals: tensor parallelism's all-reduces sum in another order."""
    if logprobs is None:
        return None
    return [{t: (round(p.logprob, 4), p.rank) for t, p in step.items()} for step in logprobs]


@pytest.fixture(scope="module")
def expected(checkpoint: Path, prompts: list[list[int]]) -> tuple[list, int]:
    """One process's tokens and weight bytes."""
    single = LLM(str(checkpoint), **ENGINE)
    return generate(single, prompts), weight_bytes(single.engine.runner.model)


@pytest.fixture
def engine(request, checkpoint: Path) -> Iterator[LLM]:
    """One distributed engine per process at a time: each test's is shut down after it."""
    tp, pp, preemption = request.param
    options = {**ENGINE, "preemption_mode": preemption, "swap_space": 0.01}
    llm = LLM(str(checkpoint), tensor_parallel_size=tp, pipeline_parallel_size=pp, **options)
    yield llm
    llm.engine.shutdown()


@pytest.mark.parametrize(
    "engine",
    [(1, 2, "recompute"), (2, 2, "swap")],  # each stage swaps its own layers' blocks
    indirect=True,
    ids=["pp2", "tp2xpp2-swap"],
)
def test_stages_generate_what_one_process_does(engine: LLM, expected, prompts) -> None:
    tokens, whole_bytes = expected
    assert generate(engine, prompts) == tokens
    stats = engine.get_stats().scheduler
    assert stats.num_preemptions > 0
    assert stats.prefix_cache.hits > 0
    per_rank = engine.engine.parts.executor.weight_bytes
    assert per_rank[0] == weight_bytes(engine.engine.runner.model)
    if len(per_rank) == 2:  # untied: the embedding on the first stage, the head on the last
        assert sum(per_rank) == whole_bytes, per_rank
    # The first stage holds two of three layers and the embedding; the last, one and the head.
    assert all(b < whole_bytes for b in per_rank), per_rank
    first = engine.engine.runner.model
    assert first.stage_layers == list(first.layers[:2])
    assert first.lm_head.__class__.__name__ == "PPMissingLayer"
    assert len(engine.engine.runner.kv_tensors) == 2  # its own layers' KV cache only
