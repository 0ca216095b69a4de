"""Online quantization (`--quantization int8 | int4`): the engine's logits and greedy tokens
against transformers' float32 model on the dequantized weights (the same rounding, done
independently of the kernels), for every architecture of the random test checkpoints."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tokenmill import LLM
from tokenmill.config import ConfigError
from tokenmill.layers.int4_linear import Int4LinearMethod, quantize_int4
from tokenmill.layers.int8_linear import Int8LinearMethod, quantize_int8
from tokenmill.layers.linear import Linear
from tokenmill_testing.quantized_checkpoints import (
    LOGPROB_TOLERANCE,
    agreed_lengths,
    greedy,
    random_prompts,
    reference_run,
    save_dequantized_checkpoint,
)

# Round trips of the weights: what each scheme's kernel multiplies by.
ROUND_TRIPS: dict[str, Callable[[str, torch.Tensor], torch.Tensor]] = {
    "int8": lambda name, w: quantize_int8(w).dequantize(),
    "int4": lambda name, w: quantize_int4(w, 32).dequantize(),
    "int4-g128": lambda name, w: quantize_int4(w, 128).dequantize(),
}
# LOGPROB_TOLERANCE (0.25) bounds |logprob - reference| of the top tokens: the kernels compute
# in bfloat16 (inputs and outputs rounded to 8 bits), the reference in float32. Measured
# 0.04-0.16 (logits' std 4).


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
