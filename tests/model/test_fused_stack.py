"""The fused decoder stack (models/llama_stack.py, csrc/decoder_stack.cpp) against transformers:
greedy tokens equal in float32 for every architecture with chunked prefill, preemption, prefix
hits and speculative drafts in the batch, at every ISA level this CPU runs; bfloat16 close;
and where it is used and where not."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import native
from tokenmill_testing.transformers_reference import greedy_reference

module = native.native_kernels()
pytestmark = pytest.mark.skipif(module is None, reason="native kernels not buildable here")
MAX_TOKENS = 10

ARCHITECTURES = {
    "llama": {},
    "llama-tied": {"architecture": "llama", "tie_word_embeddings": True},
    "mistral-sliding-window": {"architecture": "mistral", "sliding_window": 8},
    "qwen2": {},
    "qwen3": {},
    # Widths that are not multiples of the 16-row blocks: o and down write 40 of 48 padded
    # columns into rows 40 apart, and qkv's biases end mid-block.
    "qwen2-odd-widths": {
        "architecture": "qwen2",
        "hidden_size": 40,
        "num_attention_heads": 5,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "intermediate_size": 72,
    },
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request, tiny_checkpoint) -> Path:
    kwargs = dict(ARCHITECTURES[request.param])
    architecture = kwargs.pop("architecture", request.param)
    return tiny_checkpoint(architecture, **kwargs)


def prompts_for(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    phrase = [rng.randrange(3, vocab) for _ in range(7)]
    return [
        phrase * 4,
        [rng.randrange(3, vocab) for _ in range(37)],
        [*phrase * 2, 5, 6],  # shares its start with the first: a prefix hit
        phrase[:3],
        [rng.randrange(3, vocab) for _ in range(20)],
    ]


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = prompts_for(model.config.vocab_size)
    expected, logprobs = greedy_reference(model, prompts, MAX_TOKENS)
    return prompts, expected, logprobs


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def hard_engine(checkpoint: Path, num_kv_blocks: int) -> LLM:
    """Chunks of 7 tokens, blocks of 4 (few enough, preemption), prefix caching and drafts of
    the model itself (always proposed; the draft model runs its own stack): every kind of row
    in the stack's steps."""
    return LLM(
        model=str(checkpoint),
        dtype="float32",
        block_size=4,
        num_kv_blocks=num_kv_blocks,
        max_model_len=64,
        max_num_batched_tokens=7,
        enable_prefix_caching=True,
        speculative_config={
            "method": "draft_model",
            "model": str(checkpoint),
            "num_speculative_tokens": 3,
            "adaptive": False,
        },
    )


def in_two_waves(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """The first prompt alone first, so that the third hits its cached prefix."""
    first = llm.generate(prompts[:1], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    rest = llm.generate(prompts[1:], greedy(), use_tqdm=False)
    return [first, *(o.outputs[0].token_ids for o in rest)]


def test_stack_greedy_equals_transformers_at_every_isa_level(
    checkpoint: Path, reference, isa: int
) -> None:
    prompts, expected, _ = reference
    roomy = hard_engine(checkpoint, num_kv_blocks=80)
    assert roomy.engine.runner.model.decoder_stack is not None
    assert in_two_waves(roomy, prompts) == expected
    stats = roomy.get_stats().scheduler
    assert stats.prefix_cache.hits > 0
    assert stats.spec_decode is not None and stats.spec_decode.num_draft_tokens > 0
    tight = hard_engine(checkpoint, num_kv_blocks=16)
    assert in_two_waves(tight, prompts) == expected
    assert tight.get_stats().scheduler.num_preemptions > 0


def test_stack_logprobs_close_to_transformers(checkpoint: Path, reference) -> None:
    prompts, expected, ref_logprobs = reference
    llm = LLM(model=str(checkpoint), dtype="float32", max_model_len=64)
    outputs = llm.generate(prompts, greedy(logprobs=2), use_tqdm=False)
    for output, ref, tokens in zip(outputs, ref_logprobs, expected):
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        for position, (token_id, logprobs) in enumerate(zip(tokens, completion.logprobs)):
            assert abs(logprobs[token_id].logprob - ref[position, token_id].item()) < 1e-4


def test_bfloat16_stack_stays_close_to_transformers_float32(checkpoint: Path, reference) -> None:
    """bf16 weights and activations into each product (float32 residual and accumulation):
    the log-probability of the reference's greedy token stays within 0.1 of float32's while
    the continuations agree (random-weight models have near ties, so they may part)."""
    prompts, expected, ref_logprobs = reference
    llm = LLM(model=str(checkpoint), dtype="bfloat16", max_model_len=64)
    assert llm.engine.runner.model.decoder_stack is not None
    outputs = llm.generate(prompts, greedy(logprobs=5), use_tqdm=False)
    compared = 0
    for output, ref, tokens in zip(outputs, ref_logprobs, expected):
        completion = output.outputs[0]
        for position, (got, want) in enumerate(zip(completion.token_ids, tokens)):
            logprobs = completion.logprobs[position]
            if want in logprobs:
                assert abs(logprobs[want].logprob - ref[position, want].item()) < 0.1
                compared += 1
            if got != want:
                break
    assert compared >= len(prompts)


def test_the_stack_is_the_cpu_default_and_the_portable_paths_stay_selectable(
    tiny_checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = str(tiny_checkpoint("qwen3"))
    prompt = [[5, 9, 13, 200, 7, 7, 31]]

    def run(**kwargs) -> tuple[object, list[int]]:
        llm = LLM(model=checkpoint, dtype="float32", max_model_len=64, **kwargs)
        tokens = llm.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].token_ids
        return llm.engine.runner.model.decoder_stack, tokens

    stack, tokens = run()
    assert stack is not None
    for kwargs in ({"attention_backend": "torch"}, {"linear_backend": "torch"}):
        other_stack, other_tokens = run(**kwargs)
        assert other_stack is None and other_tokens == tokens
    monkeypatch.setenv("TOKENMILL_FUSED_STACK", "0")
    other_stack, other_tokens = run()
    assert other_stack is None and other_tokens == tokens


def test_an_fp8_cache_runs_the_layers_one_by_one(tiny_checkpoint) -> None:
    """The stack reads float32 and bfloat16 caches only; an FP8 one takes the module path."""
    llm = LLM(
        model=str(tiny_checkpoint("llama")),
        dtype="float32",
        max_model_len=64,
        kv_cache_dtype="fp8",
    )
    out = llm.generate([[5, 9, 13]], greedy(), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == MAX_TOKENS


def test_the_phase_profile_times_each_kind_of_stack_phase(tiny_checkpoint) -> None:
    """`benchmarks.steps inside-stack`'s source: with the profile on, every decode step's stack
    reports each layer's phases under their kinds (their weight bytes for the linears); off,
    nothing is recorded."""
    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", max_model_len=64)
    model = llm.engine.runner.model
    assert model.decoder_stack is not None
    layers = len(model.layers)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([[5, 9, 13]], params, use_tqdm=False)
    assert module.phase_profile_take() == {}  # off: nothing
    module.phase_profile_enable(True)
    try:
        llm.generate([[5, 9, 13]], params, use_tqdm=False)  # one prefill and three decode steps
    finally:
        module.phase_profile_enable(False)
    totals = module.phase_profile_take()
    assert module.phase_profile_take() == {}  # taken: cleared
    for kind in ("linear qkv", "linear o", "linear gate_up", "linear down", "attention"):
        nanoseconds, phases, weight_bytes = totals[kind]
        assert nanoseconds > 0 and phases % (4 * layers) == 0, kind
    gate_up = model.layers[0].mlp.gate_up_proj
    _, phases, weight_bytes = totals["linear gate_up"]
    assert weight_bytes >= phases * gate_up.in_features * gate_up.out_features * 4
    assert totals["rope + cache write"][1] == 4 * layers
    assert totals["activation"][1] == 4 * layers
