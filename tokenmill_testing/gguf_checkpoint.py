"""GGUF files from the random Hugging Face test checkpoints, written as llama.cpp's converter
writes them (its tensor names, q/k rows permuted for its RoPE, the tokenizer in the metadata)
with the weights in a chosen GGML type. The gguf package quantizes Q8_0 and Q4_0; it has no
Q4_K encoder, so `encode_q4_k` (round to nearest, valid blocks) is here."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from HF's rotate-half
    order into GGML's interleaved pairs."""
    rows = weight.shape[0]
    grouped = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    name = hf_name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "token_embd.weight"
    if name == "norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, layer, rest = name.split(".", 2)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF[module]}.{suffix}"


def encode_q4_k(weight: np.ndarray) -> np.ndarray:
    """Q4_K blocks of `weight` `[rows, cols]` (cols a multiple of 256): uint8 `[rows, cols //
    256 * 144]`. Per group of 32: min (at most 0) and range onto 0..15; 6-bit scales and mins
    relative to the block's fp16 `d` and `dmin`."""
    rows = weight.shape[0]
    groups = weight.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(groups.min(axis=-1), 0)
    step = np.maximum((groups.max(axis=-1) - low) / 15, 1e-8)
    d = (step.max(axis=-1) / 63).astype(np.float16)
    dmin = np.maximum(-low.max(axis=-1, initial=0), -low.min(axis=-1)) / 63
    dmin = np.maximum(dmin, 1e-8).astype(np.float16)
    sc = np.clip(np.round(step / d.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-low / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.round((groups + offset[..., None]) / scale[..., None]), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
        ],
        axis=1,
    )
    qs = q.reshape(-1, 4, 2, 32)
    nibbles = (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate(
        [
            d.view(np.uint8).reshape(-1, 2),
            dmin.view(np.uint8).reshape(-1, 2),
            packed_scales,
            nibbles,
        ],
        axis=1,
    )
    return blocks.reshape(rows, -1)


def encode(weight: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.Q4_K:
        return encode_q4_k(weight)
    return gguf.quants.quantize(weight, qtype)


def save_gguf(
    checkpoint: Path,
    path: Path,
    qtype: Q = Q.Q8_0,
    overrides: dict[str, Q] | None = None,
    architecture: str = "llama",
    config_overrides: dict | None = None,
) -> Path:
    """`checkpoint` (a llama-architecture directory) as a GGUF file: 2-D decoder weights in
    `qtype` (or `overrides[gguf name]`), everything else in F32. `config_overrides` change
    the metadata only (a file that disagrees with its tensors)."""
    config = {**json.loads((checkpoint / "config.json").read_text()), **(config_overrides or {})}
    tensors = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(file))
    writer = gguf.GGUFWriter(str(path), architecture)
    _write_metadata(writer, config)
    _write_tokenizer(writer, checkpoint)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for hf_name, tensor in tensors.items():
        name = gguf_name(hf_name)
        array = tensor.to(torch.float32).numpy()
        if name.endswith("attn_q.weight"):
            array = llama_cpp_permute(array, heads)
        elif name.endswith("attn_k.weight"):
            array = llama_cpp_permute(array, kv_heads)
        wanted = (overrides or {}).get(name, qtype if name.startswith("blk.") else Q.F32)
        if array.ndim == 1 or wanted == Q.F32:
            writer.add_tensor(name, array)
        elif wanted == Q.F16:
            writer.add_tensor(name, array.astype(np.float16))
        else:
            writer.add_tensor(name, encode(array, wanted), raw_dtype=wanted)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_vocab_size(config["vocab_size"])


def _write_tokenizer(writer: gguf.GGUFWriter, checkpoint: Path) -> None:
    """The byte-level BPE as llama.cpp writes a "gpt2" tokenizer: tokens, types, merges."""
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    added = {t["id"]: t["content"] for t in tokenizer["added_tokens"]}
    size = max([*vocab.values(), *added]) + 1
    tokens = [""] * size
    for token, index in vocab.items():
        tokens[index] = token
    types = [gguf.TokenType.NORMAL] * size
    for index, content in added.items():
        tokens[index] = content
        types[index] = gguf.TokenType.CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    writer.add_bos_token_id(ids[config["bos_token"]])
    writer.add_eos_token_id(ids[config["eos_token"]])
    if config.get("pad_token") in ids:
        writer.add_pad_token_id(ids[config["pad_token"]])
    writer.add_add_bos_token(True)
    if config.get("chat_template"):
        writer.add_chat_template(config["chat_template"])
