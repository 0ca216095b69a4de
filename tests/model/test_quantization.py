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
from tokenmill.layers.linear import Linear
from tokenmill.layers.quantized_embedding import QuantizedEmbedding
from tokenmill.quantization.int4 import Int4LinearMethod, quantize_int4
from tokenmill.quantization.int8 import Int8LinearMethod, quantize_int8
from tokenmill_testing.quantized_checkpoints import (
    TOLERANCE,
    compare_with_reference,
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
# The LM head and the embedding: int8 per row whatever the decoder's format.
HEAD_ROUND_TRIP = lambda w: quantize_int8(w).dequantize()  # noqa: E731
# Tolerances by kernel path: TOLERANCE in tokenmill_testing/quantized_checkpoints.py.


# hidden 128 so that int4-g128 has whole groups; llama tied, qwen2 with biases, qwen3 norms.
CHECKPOINTS = {
    "llama": {"hidden_size": 128, "intermediate_size": 256},
    "llama-tied": {"architecture": "llama", "hidden_size": 128, "tie_word_embeddings": True},
    "qwen2": {"hidden_size": 128, "intermediate_size": 256},
    "qwen3": {"hidden_size": 128, "intermediate_size": 256},
}


@pytest.mark.parametrize("scheme", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
@pytest.mark.slow(reason="every checkpoint x scheme through a whole engine")
def test_quantized_engine_matches_the_dequantized_float_model(
    tiny_checkpoint, tmp_path: Path, name: str, scheme: str, activation_tolerance: float
) -> None:
    kwargs = dict(CHECKPOINTS[name])
    checkpoint = tiny_checkpoint(kwargs.pop("architecture", name), **kwargs)
    reference_dir = save_dequantized_checkpoint(
        checkpoint, tmp_path / "ref", ROUND_TRIPS[scheme], HEAD_ROUND_TRIP
    )
    llm = LLM(model=str(checkpoint), dtype="float32", quantization=scheme, max_model_len=128)
    prompts = random_prompts(llm.engine.vocab_size)
    max_diff = compare_with_reference(llm, reference_dir, prompts, activation_tolerance)
    print(f"{name} {scheme}: max |logprob - reference| = {max_diff:.3f}")
    assert max_diff < activation_tolerance


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama-tied", "qwen2"])
@pytest.mark.slow(reason="the torch path of every scheme through a whole engine")
def test_the_torch_path_matches_the_dequantized_float_model(
    tiny_checkpoint, tmp_path: Path, name: str, scheme: str
) -> None:
    """`--linear-backend torch`: each product widens the codes with torch ops (the path a
    CUDA engine takes: int_codes.py), float activations; a tied embedding reads the
    LM head's rows from the same codes."""
    kwargs = dict(CHECKPOINTS[name])
    checkpoint = tiny_checkpoint(kwargs.pop("architecture", name), **kwargs)
    reference_dir = save_dequantized_checkpoint(
        checkpoint, tmp_path / "ref", ROUND_TRIPS[scheme], HEAD_ROUND_TRIP
    )
    llm = LLM(
        model=str(checkpoint),
        dtype="float32",
        quantization=scheme,
        linear_backend="torch",
        max_model_len=128,
    )
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.packed is None and m.torch_weight is not None for m in linears)
    assert model.decoder_stack is None  # op by op: the stack multiplies native layouts only
    max_diff = compare_with_reference(
        llm, reference_dir, random_prompts(llm.engine.vocab_size), TOLERANCE["float"]
    )
    assert max_diff < TOLERANCE["float"]


def test_the_float_model_differs_from_the_dequantized_one(tiny_checkpoint, tmp_path) -> None:
    """The comparison above could not pass by accident: int4 rounding changes the float
    model's logprobs by far more than the largest tolerance."""
    checkpoint = tiny_checkpoint("llama", **CHECKPOINTS["llama"])
    reference_dir = save_dequantized_checkpoint(checkpoint, tmp_path / "ref", ROUND_TRIPS["int4"])
    prompts = random_prompts(1024)
    _, float_logprobs = reference_run(checkpoint, prompts)
    _, int4_logprobs = reference_run(reference_dir, prompts)
    worst = max((a - b).abs().max().item() for a, b in zip(float_logprobs, int4_logprobs))
    assert worst > max(TOLERANCE.values())


@pytest.mark.parametrize(
    ("scheme", "method"), [("int8", Int8LinearMethod), ("int4", Int4LinearMethod)]
)
def test_decoder_linears_take_the_scheme_and_the_head_is_int8(
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
    assert linears["lm_head"].quant_method.weight_format == "int8"
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert model.embed_tokens.weight_format == "int8"
    assert "LM head and the embedding choose their own format" in caplog.text


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama", "llama-tied"])
def test_a_quantized_model_holds_no_float_weights(tiny_checkpoint, name: str, scheme: str) -> None:
    """Only the packed weights are kept: no float matrix beside them (norms and biases are
    vectors), and a tied embedding reads the LM head's rows (one table)."""
    kwargs = dict(CHECKPOINTS[name])
    checkpoint = tiny_checkpoint(kwargs.pop("architecture", name), **kwargs)
    llm = LLM(model=str(checkpoint), dtype="float32", quantization=scheme, max_model_len=64)
    model = llm.engine.runner.model
    tensors = [*model.named_parameters(), *model.named_buffers()]
    matrices = [n for n, t in tensors if t.is_floating_point() and t.dim() >= 2]
    assert [n for n in matrices if "rotary" not in n] == []
    if model.shape.tie_word_embeddings:
        assert model.embed_tokens.rows_owner() is model.lm_head


def test_unknown_quantization_is_a_config_error(tiny_checkpoint) -> None:
    with pytest.raises(ConfigError, match="quantization must be one of"):
        LLM(model=str(tiny_checkpoint("llama")), quantization="int3")
