"""GGUF files: a llama checkpoint written as llama.cpp writes it (q/k rows permuted, the
tokenizer in the metadata) in each GGML type, against transformers' float32 model on the
weights `gguf.quants.dequantize` reads from the same blocks; and bad files, one line each."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from tokenmill import LLM
from tokenmill.config import ConfigError
from tokenmill.layers.int4_linear import Int4LinearMethod
from tokenmill.layers.int8_linear import Int8LinearMethod
from tokenmill.layers.linear import Linear
from tokenmill_testing.gguf_checkpoint import encode, llama_cpp_permute, save_gguf
from tokenmill_testing.quantized_checkpoints import (
    agreed_lengths,
    greedy,
    random_prompts,
    reference_run,
    save_dequantized_checkpoint,
)

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
# |logprob - reference| allowed, per type. F16 and BF16 are dequantized (measured 0.000).
# Q4_0 / Q4_K blocks go into the int4 layout exactly but for bfloat16 scales, zeros and
# activations (measured 0.04 / 0.05). Q8_0's blocks of 32 are requantized per output row,
# the int8 kernel's layout, which adds a rounding of its own (measured 0.11).
TOLERANCE = {Q.F16: 0.02, Q.BF16: 0.02, Q.Q8_0: 0.3, Q.Q4_0: 0.25, Q.Q4_K: 0.25}
EXPECTED_METHOD = {Q.F16: None, Q.BF16: None, Q.Q8_0: Int8LinearMethod, Q.Q4_0: Int4LinearMethod}
EXPECTED_METHOD[Q.Q4_K] = Int4LinearMethod


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", **SHAPE)


def gguf_round_trip(qtype: Q, num_heads: int, num_kv_heads: int):
    """What llama.cpp's reader makes of a weight: permuted (q, k), encoded, dequantized by
    the gguf package, permuted back."""

    def round_trip(name: str, weight: torch.Tensor) -> torch.Tensor:
        heads = num_heads if ".q_proj." in name else num_kv_heads if ".k_proj." in name else 0
        array = weight.numpy()
        rows = np.arange(array.shape[0])
        order = llama_cpp_permute(rows[:, None], heads)[:, 0] if heads else rows
        array = array[order]
        stored = array.astype(np.float16) if qtype == Q.F16 else encode(array, qtype)
        dequantized = quants.dequantize(stored, qtype).astype(np.float32)
        restored = np.empty_like(dequantized)
        restored[order] = dequantized
        return torch.from_numpy(restored)

    return round_trip


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_K], ids=lambda q: q.name)
def test_gguf_matches_the_dequantized_float_model(checkpoint, tmp_path: Path, qtype) -> None:
    path = save_gguf(checkpoint, tmp_path / "model.gguf", qtype)
    reference_dir = save_dequantized_checkpoint(
        checkpoint, tmp_path / "ref", gguf_round_trip(qtype, 4, 2)
    )
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    method = EXPECTED_METHOD[qtype]
    decoder = [m for n, m in llm.engine.runner.model.named_modules() if n.startswith("layers.")]
    linears = [m for m in decoder if isinstance(m, Linear)]
    assert method is None or all(isinstance(m.quant_method, method) for m in linears)
    prompts = random_prompts(llm.engine.vocab_size)
    expected, ref_logprobs = reference_run(reference_dir, prompts)
    outputs = llm.generate(prompts, greedy(logprobs=3), use_tqdm=False)
    agreed = agreed_lengths([o.outputs[0].token_ids for o in outputs], expected, ref_logprobs)
    max_diff = 0.0
    for output, ref, length in zip(outputs, ref_logprobs, agreed, strict=True):
        for position, logprobs in enumerate(output.outputs[0].logprobs[: length + 1]):
            for candidate, logprob in logprobs.items():
                max_diff = max(max_diff, abs(logprob.logprob - ref[position, candidate].item()))
    print(f"{qtype.name}: max |logprob - reference| = {max_diff:.3f}")
    assert max_diff < TOLERANCE[qtype]


def test_the_tokenizer_comes_from_the_gguf_metadata(checkpoint, tmp_path: Path) -> None:
    path = save_gguf(checkpoint, tmp_path / "model.gguf", Q.Q8_0)
    text = "The old farmer reads 1234 letters. Café!"
    from_gguf = LLM(model=str(path), max_model_len=64).get_tokenizer()
    from_dir = LLM(model=str(checkpoint), max_model_len=64).get_tokenizer()
    assert from_gguf(text).input_ids == from_dir(text).input_ids


def test_a_mixed_fused_layer_is_dequantized_and_named(checkpoint, tmp_path, caplog) -> None:
    """q and k in Q4_K, v in Q8_0 (llama.cpp's *_M mixes): no single layout holds the fused
    QKV, so it is dequantized, and the log line names it."""
    overrides = {f"blk.{i}.attn_v.weight": Q.Q8_0 for i in range(2)}
    path = save_gguf(checkpoint, tmp_path / "mixed.gguf", Q.Q4_K, overrides)
    with caplog.at_level("INFO", logger="tokenmill"):
        llm = LLM(model=str(path), dtype="float32", max_model_len=64)
    model = llm.engine.runner.model
    assert not isinstance(model.layers[0].self_attn.qkv_proj.quant_method, Int4LinearMethod)
    assert isinstance(model.layers[0].mlp.down_proj.quant_method, Int4LinearMethod)
    assert "blk.0.attn_q/attn_k/attn_v" in caplog.text


def test_a_truncated_gguf_is_one_config_error(checkpoint, tmp_path: Path) -> None:
    path = save_gguf(checkpoint, tmp_path / "model.gguf", Q.Q4_0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="not a complete GGUF file"):
        LLM(model=str(path), max_model_len=64)


def test_an_unsupported_gguf_architecture_is_one_config_error(checkpoint, tmp_path) -> None:
    path = save_gguf(checkpoint, tmp_path / "model.gguf", Q.Q8_0, architecture="gpt2")
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gpt2'"):
        LLM(model=str(path), max_model_len=64)


def test_a_tensor_disagreeing_with_the_metadata_is_one_config_error(checkpoint, tmp_path) -> None:
    path = save_gguf(
        checkpoint, tmp_path / "model.gguf", Q.Q4_0, config_overrides={"intermediate_size": 384}
    )
    with pytest.raises(ConfigError, match=r"mlp\..*_proj.weight. has shape"):
        LLM(model=str(path), max_model_len=64)


def test_online_quantization_of_a_gguf_file_is_refused(checkpoint, tmp_path: Path) -> None:
    path = save_gguf(checkpoint, tmp_path / "model.gguf", Q.Q8_0)
    with pytest.raises(ConfigError, match="is a GGUF file"):
        LLM(model=str(path), quantization="int4", max_model_len=64)
