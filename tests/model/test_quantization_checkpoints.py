"""Pre-quantized Hugging Face checkpoints (compressed-tensors W8A8 and W4A16, GPTQ, AWQ),
written in their exact on-disk formats, against transformers' float32 model on the same
dequantized weights; unsupported settings are one ConfigError line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tokenmill import LLM
from tokenmill.config import ConfigError
from tokenmill.layers.linear import Linear
from tokenmill.quantization.int4 import Int4LinearMethod
from tokenmill.quantization.int8 import Int8LinearMethod
from tokenmill_testing.hf_quantized_checkpoints import SCHEMES, save_quantized_checkpoint
from tokenmill_testing.quantized_checkpoints import (
    compare_with_reference,
    random_prompts,
)

SHAPE = {"hidden_size": 256, "intermediate_size": 512}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", **SHAPE)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prequantized_checkpoint_matches_its_dequantized_float_model(
    checkpoint: Path, tmp_path: Path, scheme: str, activation_tolerance: float
) -> None:
    quantized, reference = save_quantized_checkpoint(
        checkpoint, tmp_path / "q", tmp_path / "ref", scheme
    )
    llm = LLM(model=str(quantized), dtype="float32", max_model_len=128)
    method = Int8LinearMethod if scheme == "ct-w8a8" else Int4LinearMethod
    modules = llm.engine.runner.model.named_modules()
    decoder = [m for n, m in modules if n.startswith("layers.") and isinstance(m, Linear)]
    assert decoder and all(isinstance(m.quant_method, method) for m in decoder)
    prompts = random_prompts(llm.engine.vocab_size)
    max_diff = compare_with_reference(llm, reference, prompts, activation_tolerance)
    print(f"{scheme}: max |logprob - reference| = {max_diff:.3f}")
    assert max_diff < activation_tolerance


def with_quantization_config(checkpoint: Path, tmp_path: Path, config: dict) -> Path:
    shutil.copytree(checkpoint, tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "quantization_config": config}))
    return tmp_path / "ckpt"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "bitsandbytes"}, "unknown quantization type 'bitsandbytes'"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
    ],
)
def test_unsupported_quantization_config_is_one_config_error(
    checkpoint: Path, tmp_path: Path, config: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        LLM(model=str(with_quantization_config(checkpoint, tmp_path, config)), max_model_len=64)
