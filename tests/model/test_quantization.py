"""Online quantization (`--quantization int8 | int4`): the engine's logits and greedy tokens
against transformers' float32 model on the dequantized weights (the same rounding, done
independently of the kernels), for every architecture of the random test checkpoints."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError
from tokenmill.layers.int4_linear import Int4LinearMethod, quantize_int4
from tokenmill.layers.int8_linear import Int8LinearMethod, quantize_int8
from tokenmill.layers.linear import Linear
from tokenmill.testing.quantized_checkpoints import save_dequantized_checkpoint

MAX_TOKENS = 10
PROMPT_LENS = [1, 6, 19, 40]
# Round trips of the weights: what each scheme's kernel multiplies by.
ROUND_TRIPS: dict[str, Callable[[str, torch.Tensor], torch.Tensor]] = {
    "int8": lambda name, w: quantize_int8(w).dequantize(),
    "int4": lambda name, w: quantize_int4(w, 32).dequantize(),
    "int4-g128": lambda name, w: quantize_int4(w, 128).dequantize(),
}
# |logprob - reference| of the top tokens: the kernels compute in bfloat16 (inputs and
# outputs rounded to 8 bits), the reference in float32. Measured 0.02-0.09 (logits' std 4).
LOGPROB_TOLERANCE = 0.25


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def reference_run(checkpoint: Path, prompts: list[list[int]]):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            logprobs.append(torch.log_softmax(torch.cat(out.logits).float(), dim=-1))
    return tokens, logprobs


def random_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def agreed_lengths(
    got: list[list[int]], expected: list[list[int]], ref_logprobs: list[torch.Tensor]
) -> list[int]:
    """How many greedy tokens of each sequence equal the reference's. A sequence may part
    from it only where the reference's own top two are closer than the tolerance (a tie for
    bfloat16 arithmetic; after it the two continue from different tokens, so only the
    tokens up to and including that one compare). Most tokens must match."""
    lengths = []
    for ours, theirs, ref in zip(got, expected, ref_logprobs, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
        if same < len(theirs):
            margin = ref[same, theirs[same]] - ref[same, ours[same]]
            assert margin < LOGPROB_TOLERANCE, f"parted at {same} with margin {margin:.3f}"
        lengths.append(same)
    assert sum(lengths) >= 0.75 * sum(len(t) for t in expected)
    return lengths


# hidden 128 so that int4-g128 has whole groups; llama tied, qwen2 with biases, qwen3 norms.
CHECKPOINTS = {
    "llama": {"hidden_size": 128, "intermediate_size": 256},
    "llama-tied": {"architecture": "llama", "hidden_size": 128, "tie_word_embeddings": True},
    "qwen2": {"hidden_size": 128, "intermediate_size": 256},
    "qwen3": {"hidden_size": 128, "intermediate_size": 256},
}


@pytest.mark.parametrize("scheme", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_quantized_engine_matches_the_dequantized_float_model(
    tiny_checkpoint, tmp_path: Path, name: str, scheme: str
) -> None:
    kwargs = dict(CHECKPOINTS[name])
    checkpoint = tiny_checkpoint(kwargs.pop("architecture", name), **kwargs)
    reference_dir = save_dequantized_checkpoint(checkpoint, tmp_path / "ref", ROUND_TRIPS[scheme])
    llm = LLM(model=str(checkpoint), dtype="float32", quantization=scheme, max_model_len=128)
    prompts = random_prompts(llm.engine.vocab_size)
    expected, ref_logprobs = reference_run(reference_dir, prompts)
    outputs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    agreed = agreed_lengths(tokens, expected, ref_logprobs)
    max_diff = 0.0
    for output, ref, length in zip(outputs, ref_logprobs, agreed, strict=True):
        for position, logprobs in enumerate(output.outputs[0].logprobs[: length + 1]):
            for candidate, logprob in logprobs.items():
                max_diff = max(max_diff, abs(logprob.logprob - ref[position, candidate].item()))
    print(f"{name} {scheme}: max |logprob - reference| = {max_diff:.3f}")
    assert max_diff < LOGPROB_TOLERANCE


def test_the_float_model_differs_from_the_dequantized_one(tiny_checkpoint, tmp_path) -> None:
    """The comparison above could not pass by accident: int4 rounding changes the float
    model's logprobs by far more than the tolerance."""
    checkpoint = tiny_checkpoint("llama", **CHECKPOINTS["llama"])
    reference_dir = save_dequantized_checkpoint(checkpoint, tmp_path / "ref", ROUND_TRIPS["int4"])
    prompts = random_prompts(1024)
    _, float_logprobs = reference_run(checkpoint, prompts)
    _, int4_logprobs = reference_run(reference_dir, prompts)
    worst = max((a - b).abs().max().item() for a, b in zip(float_logprobs, int4_logprobs))
    assert worst > LOGPROB_TOLERANCE


@pytest.mark.parametrize(
    ("scheme", "method"), [("int8", Int8LinearMethod), ("int4", Int4LinearMethod)]
)
def test_decoder_linears_are_quantized_and_the_lm_head_is_not(
    tiny_checkpoint, scheme: str, method: type, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint = tiny_checkpoint("llama", **CHECKPOINTS["llama"])
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        llm = LLM(model=str(checkpoint), dtype="float32", quantization=scheme, max_model_len=64)
    model = llm.engine.runner.model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    decoder = [m for n, m in linears.items() if n.startswith("layers.")]
    assert len(decoder) == 4 * model.shape.num_layers
    assert all(isinstance(m.quant_method, method) for m in decoder)
    assert not isinstance(linears["lm_head"].quant_method, Int8LinearMethod | Int4LinearMethod)
    assert "LM head keep their own format" in caplog.text


def test_unknown_quantization_is_a_config_error(tiny_checkpoint) -> None:
    with pytest.raises(ConfigError, match="quantization must be one of"):
        LLM(model=str(tiny_checkpoint("llama")), quantization="int3")
