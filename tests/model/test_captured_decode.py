"""Decode-only steps through the captured step (padded batch sizes, static buffers, scratch
block) give transformers' greedy tokens, for every architecture, with chunked prefill,
preemption and prefix-cache hits around them; and so does the CPU's compiled step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.worker.capture_backends import eager_capture
from tokenmill_testing.transformers_reference import greedy_reference

MAX_TOKENS = 10
ARCHITECTURES = {
    "llama": {},
    "llama-tied": {"architecture": "llama", "tie_word_embeddings": True},
    "mistral-sliding-window": {"architecture": "mistral", "sliding_window": 8},
    "qwen2": {},
    "qwen3": {},
}
SCENARIOS = {
    "batch": {},
    "chunked-prefill": {"max_num_batched_tokens": 7},
    "preemption": {"num_kv_blocks": 20, "max_model_len": 80},
    "prefix-hits": {"enable_prefix_caching": True},
}
# The traced step (torch.compile's graph capture) costs seconds per key: each architecture
# runs it in one scenario, and each scenario runs in at least one architecture.
TRACED_SCENARIO = {
    "llama": "batch",
    "llama-tied": "preemption",
    "mistral-sliding-window": "chunked-prefill",
    "qwen2": "prefix-hits",
    "qwen3": "chunked-prefill",
}


def reference_tokens(checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return greedy_reference(model, prompts, MAX_TOKENS)[0]


def make_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 5, 17, 33, 60)]
    rng = random.Random(2)
    shared = [rng.randrange(3, vocab) for _ in range(12)]
    return prompts + [[*shared, rng.randrange(3, vocab)] for _ in range(2)]  # a shared prefix


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def case(request, tiny_checkpoint):
    kwargs = dict(ARCHITECTURES[request.param])
    architecture = kwargs.pop("architecture", request.param)
    checkpoint = tiny_checkpoint(architecture, **kwargs)
    prompts = make_prompts(1024)
    return request.param, checkpoint, prompts, reference_tokens(checkpoint, prompts)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_bucketed_decode_step_equals_transformers(case, scenario: str) -> None:
    check_bucketed_decode(case, scenario, capture=eager_capture)


def test_traced_decode_step_equals_transformers(case) -> None:
    """Each key's forward through dynamo and AOT autograd's functionalisation (of the in-place
    RoPE and KV writes), without inductor's code generation, which the compiled tests below
    run."""
    check_bucketed_decode(case, TRACED_SCENARIO[case[0]], compile_backend="aot_eager")


def check_bucketed_decode(case, scenario: str, **capture) -> None:
    _, checkpoint, prompts, expected = case
    llm = LLM(
        model=str(checkpoint),
        dtype="float32",
        block_size=4,
        max_num_seqs=6,
        **SCENARIOS[scenario],
    )
    runner = llm.engine.runner
    assert runner.decode_step is None  # CPU default: eager
    runner.use_captured_decode(6, llm.engine.max_model_len, **capture)
    if scenario == "prefix-hits":
        generate(llm, prompts)  # the second run hits the cache
    assert generate(llm, prompts) == expected
    assert runner.decode_step.num_runs > 0
    stats = llm.get_stats().scheduler
    if scenario == "preemption":
        assert stats.num_preemptions > 0
    if scenario == "prefix-hits":
        assert stats.prefix_cache.hits > 0


def test_compiled_decode_step_equals_eager_and_transformers(tiny_checkpoint) -> None:
    """One small compile: four equal prompts decode under a single (batch, blocks) key."""
    checkpoint = tiny_checkpoint("llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1024) for _ in range(20)] for _ in range(3)]
    expected = reference_tokens(checkpoint, prompts)
    eager = LLM(model=str(checkpoint), dtype="float32", enforce_eager=True)
    assert eager.engine.runner.decode_step is None
    assert generate(eager, prompts) == expected
    llm = LLM(model=str(checkpoint), dtype="float32", max_num_seqs=4, enforce_eager=False)
    step = llm.engine.runner.decode_step
    assert step is not None
    assert generate(llm, prompts) == expected
    assert step.num_runs == MAX_TOKENS - 1
    assert len(step.steps) == 1 and step.capture_seconds > 0


def test_compiled_bfloat16_decode_step_is_greedy_under_transformers(tiny_checkpoint) -> None:
    """bf16 rounds differently eager, compiled (inductor computes fused elementwise ops in
    float32) and in transformers, so near-ties may flip: every token the compiled engine
    picks must score within a small margin of the best under transformers' bf16 logits of
    the same sequence."""
    checkpoint = tiny_checkpoint("qwen3", dtype=torch.bfloat16)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 1024) for _ in range(20)] for _ in range(3)]
    llm = LLM(model=str(checkpoint), dtype="bfloat16", max_num_seqs=4, enforce_eager=False)
    outputs = generate(llm, prompts)
    assert llm.engine.runner.decode_step.num_runs == MAX_TOKENS - 1
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        for prompt, output in zip(prompts, outputs):
            logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
            logits = logits.float()
            chosen = logits.gather(1, torch.tensor(output)[:, None])[:, 0]
            margin = logits.max(dim=1).values - chosen
            assert margin.max() <= 0.02 * logits.abs().max(), margin
