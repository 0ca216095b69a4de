"""GGUF files: a llama checkpoint written as llama.cpp writes it (q/k rows permuted, the
tokenizer in the metadata) in each GGML type, against transformers' float32 model on the
weights `gguf.quants.dequantize` reads from the same blocks; and bad files, one line each."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, quants

from tokenmill import LLM
from tokenmill.config import ConfigError
from tokenmill.layers.linear import Linear
from tokenmill.layers.quantized_embedding import QuantizedEmbedding
from tokenmill.quantization.int4 import Int4LinearMethod
from tokenmill.quantization.int8 import Int8LinearMethod
from tokenmill_testing.gguf_checkpoint import encode, llama_cpp_permute, save_gguf
from tokenmill_testing.quantized_checkpoints import (
    activation_path,
    compare_with_reference,
    random_prompts,
    save_dequantized_checkpoint,
)

SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
# Every quantized type's blocks go into a layout of their own code width as they are (scales
# rounded to float16: exact for all but the K-quants' d x sc products), the LM head and the
# embedding too; F16 and BF16 are dequantized. Tolerances by kernel path
# (quantized_checkpoints.py): with float activations measured 0.000-0.002.
EXPECTED_METHOD = {
    Q.F16: (None, None),
    Q.BF16: (None, None),
    Q.Q8_0: (Int8LinearMethod, "int8-g32"),
    Q.Q5_0: (Int8LinearMethod, "int5-g32"),
    Q.Q5_K: (Int8LinearMethod, "int5-g32"),
    Q.Q6_K: (Int8LinearMethod, "int6-g16"),
    Q.Q4_0: (Int4LinearMethod, "int4-g32"),
    Q.Q4_K: (Int4LinearMethod, "int4-g32"),
    Q.Q3_K: (Int8LinearMethod, "int3-g16"),
    Q.Q2_K: (Int8LinearMethod, "int2-g16"),
    Q.IQ4_NL: (Int8LinearMethod, "iq4nl-g32"),
    Q.IQ4_XS: (Int8LinearMethod, "iq4nl-g32"),
}
HEADS = ("token_embd.weight", "output.weight")


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


@pytest.mark.parametrize("qtype", list(EXPECTED_METHOD), ids=lambda q: q.name)
@pytest.mark.slow(reason="every GGUF type through a whole engine")
def test_gguf_matches_the_dequantized_float_model(
    checkpoint, tmp_path: Path, qtype, activation_tolerance: float
) -> None:
    """Decoder, LM head and embedding all in `qtype` (llama.cpp's pure mixes)."""
    path = save_gguf(checkpoint, tmp_path / "model.gguf", qtype, dict.fromkeys(HEADS, qtype))
    round_trip = gguf_round_trip(qtype, 4, 2)
    reference_dir = save_dequantized_checkpoint(
        checkpoint, tmp_path / "ref", round_trip, lambda w: round_trip("head", w)
    )
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    method, weight_format = EXPECTED_METHOD[qtype]
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert method is None or all(isinstance(m.quant_method, method) for m in linears)
    assert weight_format is None or {m.quant_method.weight_format for m in linears} == {
        weight_format
    }
    assert isinstance(model.embed_tokens, QuantizedEmbedding) == (method is not None)
    prompts = random_prompts(llm.engine.vocab_size)
    max_diff = compare_with_reference(llm, reference_dir, prompts, activation_tolerance)
    print(f"{qtype.name}: max |logprob - reference| = {max_diff:.3f}")
    assert max_diff < activation_tolerance


def test_the_tokenizer_comes_from_the_gguf_metadata(checkpoint, tmp_path: Path) -> None:
    path = save_gguf(checkpoint, tmp_path / "model.gguf", Q.Q8_0)
    text = "The old farmer reads 1234 letters. Café!"
    from_gguf = LLM(model=str(path), max_model_len=64).get_tokenizer()
    from_dir = LLM(model=str(checkpoint), max_model_len=64).get_tokenizer()
    assert from_gguf(text).input_ids == from_dir(text).input_ids


def packed_bytes(layer: Linear) -> int:
    """Bytes of a quantized layer's packed codes, scales and offsets (each part's, for a layer
    of mixed parts)."""
    packs = [part.packed for part in getattr(layer, "parts", None) or [layer]]
    tensors = [(p.codes, p.scales, p.offsets, p.super_scales) for p in packs]
    return sum(t.numel() * t.element_size() for ts in tensors for t in ts if t is not None)


def file_bytes(path: Path, names: list[str]) -> int:
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    return sum(int(tensors[name].n_bytes) for name in names)


@pytest.mark.parametrize(
    ("base", "v_type", "qkv_format"),
    [
        (Q.Q4_K, Q.Q6_K, "int4-g32+int4-g32+int6-g16"),  # llama.cpp's *_M mixes
        (Q.IQ4_XS, Q.Q5_K, "iq4nl-g32+iq4nl-g32+int5-g32"),
    ],
    ids=lambda value: value.name if isinstance(value, Q) else None,
)
def test_a_mixed_fused_layer_holds_each_part_in_its_own_format(
    checkpoint, tmp_path: Path, base: Q, v_type: Q, qkv_format: str
) -> None:
    """q and k in one type, v in another: the fused QKV holds q and k in their layout and v in
    its own (within 10 % of the parts' bytes in the file, not the widest part's width for
    all), and the engine, through the fused native stack, computes the model
    `gguf.quants.dequantize` reads (float activations: to float32 rounding)."""
    mixed = {f"blk.{i}.attn_v.weight": v_type for i in range(2)}
    path = save_gguf(checkpoint, tmp_path / "mixed.gguf", base, mixed)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    model = llm.engine.runner.model
    assert model.decoder_stack is not None
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.quant_method.weight_format == qkv_format
    parts = [f"blk.0.attn_{p}.weight" for p in "qkv"]
    assert packed_bytes(qkv) <= 1.1 * file_bytes(path, parts)
    base_trip, v_trip = gguf_round_trip(base, 4, 2), gguf_round_trip(v_type, 4, 2)
    reference_dir = save_dequantized_checkpoint(
        checkpoint,
        tmp_path / "ref",
        lambda name, w: (v_trip if ".v_proj." in name else base_trip)(name, w),
    )
    with activation_path("float") as tolerance:
        max_diff = compare_with_reference(llm, reference_dir, random_prompts(1024), tolerance)
    assert max_diff < tolerance


def test_a_q3_k_m_mix_holds_each_part_in_its_own_format(checkpoint, tmp_path: Path) -> None:
    """llama.cpp's Q3_K_M mixes: v in Q5_K beside q and k in Q3_K, up in Q4_K beside gate in
    Q3_K: each part in its own layout, and the engine computes the file's model."""
    mixed = {f"blk.{i}.attn_v.weight": Q.Q5_K for i in range(2)}
    mixed |= {f"blk.{i}.ffn_up.weight": Q.Q4_K for i in range(2)}
    path = save_gguf(checkpoint, tmp_path / "mixed.gguf", Q.Q3_K, mixed)
    llm = LLM(model=str(path), dtype="float32", max_model_len=128)
    layer = llm.engine.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.quant_method.weight_format == "int3-g16+int3-g16+int5-g32"
    assert layer.mlp.gate_up_proj.quant_method.weight_format == "int3-g16+int4-g32"
    trips = {t: gguf_round_trip(t, 4, 2) for t in (Q.Q3_K, Q.Q4_K, Q.Q5_K)}

    def round_trip(name: str, weight: torch.Tensor) -> torch.Tensor:
        qtype = Q.Q5_K if ".v_proj." in name else Q.Q4_K if ".up_proj." in name else Q.Q3_K
        return trips[qtype](name, weight)

    reference_dir = save_dequantized_checkpoint(checkpoint, tmp_path / "ref", round_trip)
    with activation_path("float") as tolerance:
        max_diff = compare_with_reference(llm, reference_dir, random_prompts(1024), tolerance)
    assert max_diff < tolerance


def test_a_type_without_an_int_form_is_dequantized_and_named(checkpoint, tmp_path, caplog) -> None:
    """A fused layer with an F16 part: dequantized to floats, and the log line names it."""
    overrides = {f"blk.{i}.attn_v.weight": Q.F16 for i in range(2)}
    path = save_gguf(checkpoint, tmp_path / "mixed.gguf", Q.Q4_K, overrides)
    with caplog.at_level("INFO", logger="tokenmill"):
        llm = LLM(model=str(path), dtype="float32", max_model_len=64)
    model = llm.engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.quant_method.holds_float_weight
    assert isinstance(model.layers[0].mlp.down_proj.quant_method, Int4LinearMethod)
    assert "blk.0.attn_q/attn_k/attn_v" in caplog.text


def test_a_truncated_gguf_is_one_config_error(checkpoint, tmp_path: Path) -> None:
    path = save_gguf(checkpoint, tmp_path / "model.gguf", Q.Q4_0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="is truncated: it is"):
        LLM(model=str(path), max_model_len=64)


def test_an_unsupported_gguf_architecture_is_one_config_error(checkpoint, tmp_path) -> None:
    path = save_gguf(checkpoint, tmp_path / "model.gguf", Q.Q8_0, architecture="gpt2")
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gpt2'") as error:
        LLM(model=str(path), max_model_len=64)
    message = str(error.value)  # one line naming what the model registry's families read
    assert "\n" not in message
    for supported in ("llama", "gemma3", "phi3", "llama with llama.expert_count", "qwen3moe"):
        assert supported in message


def test_a_tensor_disagreeing_with_the_metadata_is_one_config_error(checkpoint, tmp_path) -> None:
    path = save_gguf(
        checkpoint, tmp_path / "model.gguf", Q.Q4_0, config_overrides={"intermediate_size": 384}
    )
    match = r"feed_forward_length is 384, but the tensor layers\.0\.mlp\.gate_proj\.weight"
    with pytest.raises(ConfigError, match=match):
        LLM(model=str(path), max_model_len=64)


def test_online_quantization_of_a_gguf_file_is_refused(checkpoint, tmp_path: Path) -> None:
    path = save_gguf(checkpoint, tmp_path / "model.gguf", Q.Q8_0)
    with pytest.raises(ConfigError, match="is a GGUF file"):
        LLM(model=str(path), quantization="int4", max_model_len=64)
