"""tokenmill against the Hugging Face `transformers` implementation of the same checkpoints:
greedy output token for token in float32, with prompts of varied lengths in one batch, under
heavy chunking and under preemption; log-probabilities close to the reference's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill_testing.transformers_reference import greedy_reference

MAX_TOKENS = 12
PROMPT_LENS = [1, 5, 17, 33, 64]

ARCHITECTURES = {
    "llama": {},
    "llama-tied-llama3-rope": {
        "architecture": "llama",
        "tie_word_embeddings": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "mistral": {},
    # Decodes attend through a mask only where needed; a window forces one.
    "mistral-sliding-window": {"architecture": "mistral", "sliding_window": 8},
    "qwen2": {},
    "qwen3": {},
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tiny_checkpoint) -> Path:
    kwargs = dict(ARCHITECTURES[request.param])
    architecture = kwargs.pop("architecture", request.param)
    return tiny_checkpoint(architecture, **kwargs)


@pytest.fixture(scope="module")
def reference(checkpoint: Path):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
    expected, logprobs = greedy_reference(model, prompts, MAX_TOKENS)
    return prompts, expected, logprobs


def greedy(max_tokens: int = MAX_TOKENS, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def generate_token_ids(llm: LLM, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    outputs = llm.generate(prompts, greedy(**kwargs), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow(reason="Hugging Face generate per architecture")
def test_greedy_batch_equals_transformers(checkpoint: Path, reference) -> None:
    prompts, expected, _ = reference
    llm = LLM(model=str(checkpoint), dtype="float32")
    assert generate_token_ids(llm, prompts) == expected


def test_greedy_with_heavy_chunking_equals_transformers(checkpoint: Path, reference) -> None:
    prompts, expected, _ = reference
    llm = LLM(model=str(checkpoint), dtype="float32", max_num_batched_tokens=7, block_size=4)
    assert generate_token_ids(llm, prompts) == expected
    assert llm.get_stats().num_steps > sum(PROMPT_LENS) // 7


def test_greedy_under_preemption_equals_transformers(checkpoint: Path, reference) -> None:
    prompts, expected, _ = reference
    # 20 blocks of 4 tokens: the longest request (76 tokens) fits alone, the batch does not.
    llm = LLM(
        model=str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=20, max_model_len=80
    )
    assert generate_token_ids(llm, prompts) == expected
    assert llm.get_stats().scheduler.num_preemptions > 0


PREFILL_LIMITS = {
    # A target no step meets: every prompt moves by the progress floor.
    "tiny-itl-target": {"itl_target_ms": 0.001},
    "itl-target-and-threshold": {
        "itl_target_ms": 5.0,
        "long_prefill_token_threshold": 8,
        "max_num_partial_prefills": 2,
    },
}


@pytest.mark.parametrize("limits", sorted(PREFILL_LIMITS))
@pytest.mark.slow(reason="Hugging Face generate per architecture and limit")
def test_greedy_under_prefill_limits_equals_transformers(
    checkpoint: Path, reference, limits: str
) -> None:
    prompts, expected, _ = reference
    llm = LLM(model=str(checkpoint), dtype="float32", block_size=4, **PREFILL_LIMITS[limits])
    assert generate_token_ids(llm, prompts) == expected
    stats = llm.get_stats().scheduler.itl_target
    assert stats is not None and sum(stats.budget_bucket_counts) > 0


def test_logprobs_close_to_transformers(checkpoint: Path, reference) -> None:
    prompts, _, ref_logprobs = reference
    llm = LLM(model=str(checkpoint), dtype="float32")
    outputs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    max_diff = 0.0
    for output, ref in zip(outputs, ref_logprobs):
        completion = output.outputs[0]
        for position, (token_id, logprobs) in enumerate(
            zip(completion.token_ids, completion.logprobs)
        ):
            for candidate, logprob in logprobs.items():
                diff = abs(logprob.logprob - ref[position, candidate].item())
                max_diff = max(max_diff, diff)
            top = torch.topk(ref[position], 3).indices.tolist()
            assert set(top) <= set(logprobs), "top-3 tokens differ from the reference"
            assert logprobs[token_id].rank == 1
    print(f"max |logprob - reference| = {max_diff:.2e}")
    assert max_diff < 1e-4


def test_seeded_sampling_is_independent_of_batch_composition(checkpoint: Path, reference) -> None:
    prompts, _, _ = reference
    llm = LLM(model=str(checkpoint), dtype="float32")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=7, ignore_eos=True)
    alone = llm.generate([prompts[2]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = (
        llm.generate([prompts[4], prompts[2], prompts[0]], [other, seeded, other], use_tqdm=False)[
            1
        ]
        .outputs[0]
        .token_ids
    )
    assert alone == mixed
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=10, ignore_eos=True)
    assert llm.generate([prompts[2]], reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone


@pytest.mark.slow(reason="Hugging Face generate per architecture")
def test_repetition_penalty_matches_transformers(checkpoint: Path, reference) -> None:
    prompts, _, _ = reference
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for prompt in prompts[:3]:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                repetition_penalty=1.5,
                pad_token_id=0,
            )
            expected.append(out[0, len(prompt) :].tolist())
    llm = LLM(model=str(checkpoint), dtype="float32")
    assert generate_token_ids(llm, prompts[:3], repetition_penalty=1.5) == expected
