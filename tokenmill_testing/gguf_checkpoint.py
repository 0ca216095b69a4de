"""GGUF files from the random Hugging Face test checkpoints, written as llama.cpp's converter
writes them (its tensor names, q/k rows permuted for its RoPE, the tokenizer in the metadata)
with the weights in a chosen GGML type. The gguf package quantizes Q8_0, Q5_0 and Q4_0; it has
no K-quant encoders, so round-to-nearest ones for Q4_K, Q5_K and Q6_K are here (valid blocks,
read back by the gguf package's own decoders in the tests)."""

from __future__ import annotations

import json
import math
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


def _k_quant(weight: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's shared part for `weight` `[rows, cols]` (cols a multiple of 256): per
    group of 32 its min (at most 0) and range onto 0..levels-1, 6-bit scales and mins relative
    to the block's fp16 `d` and `dmin`. Returns (the first 16 bytes of each block: d, dmin,
    packed scales, `[blocks, 16]`; the values `[blocks, 8, 32]`)."""
    groups = weight.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(groups.min(axis=-1), 0)
    step = np.maximum((groups.max(axis=-1) - low) / (levels - 1), 1e-8)
    d = (step.max(axis=-1) / 63).astype(np.float16)
    dmin = np.maximum(-low.max(axis=-1, initial=0), -low.min(axis=-1)) / 63
    dmin = np.maximum(dmin, 1e-8).astype(np.float16)
    sc = np.clip(np.round(step / d.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-low / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.round((groups + offset[..., None]) / scale[..., None])
    q = np.clip(q, 0, levels - 1).astype(np.uint8)
    packed_scales = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4),
        ],
        axis=1,
    )
    head = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed_scales],
        axis=1,
    )
    return head, q


def _low_nibbles(q: np.ndarray) -> np.ndarray:
    """`[blocks, 8, 32]` values -> 128 bytes: chunk c holds group 2c low, 2c + 1 high."""
    qs = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (qs[:, :, 0] | (qs[:, :, 1] << 4)).reshape(-1, 128)


def encode_q4_k(weight: np.ndarray) -> np.ndarray:
    """Q4_K blocks of `weight` `[rows, cols]`: uint8 `[rows, cols // 256 * 144]`, round to
    nearest (valid blocks; llama.cpp searches its scales, this does not)."""
    head, q = _k_quant(weight, 16)
    return np.concatenate([head, _low_nibbles(q)], axis=1).reshape(weight.shape[0], -1)


def encode_q5_k(weight: np.ndarray) -> np.ndarray:
    """Q5_K blocks (176 bytes per 256 weights): Q4_K's with a fifth bit per weight (qh: bit g
    of byte l is weight l of group g)."""
    head, q = _k_quant(weight, 32)
    high = (q >> 4) & 1  # [blocks, 8, 32]
    qh = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    blocks = np.concatenate([head, qh, _low_nibbles(q)], axis=1)
    return blocks.reshape(weight.shape[0], -1)


def encode_q6_k(weight: np.ndarray) -> np.ndarray:
    """Q6_K blocks (210 bytes per 256 weights): an int8 scale per 16 relative to the block's
    fp16 `d`, values -32..31 stored + 32 as 4 low bits (ql) and 2 high ones (qh)."""
    groups = weight.astype(np.float32).reshape(-1, 16, 16)
    step = np.maximum(np.abs(groups).max(axis=-1) / 31.5, 1e-8)  # [blocks, 16]
    d = (step.max(axis=-1) / 127).astype(np.float16)
    sc = np.clip(np.round(step / d.astype(np.float32)[:, None]), 1, 127).astype(np.int8)
    scale = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.round(groups / scale[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)  # [blocks, 2, 64]
    pairs = ((q >> 4) & 3).reshape(-1, 2, 4, 32)
    qh = (pairs << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2)
    blocks = np.concatenate(
        [
            ql.reshape(-1, 128),
            qh.astype(np.uint8).reshape(-1, 64),
            sc.view(np.uint8),
            d.view(np.uint8).reshape(-1, 2),
        ],
        axis=1,
    )
    return blocks.reshape(weight.shape[0], -1)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _pack_pairs(values: np.ndarray) -> np.ndarray:
    """`[blocks, 256]` 2-bit values -> 64 bytes: two halves of 32 bytes, bit pair i of byte
    l holding weight 128 h + 32 i + l (Q2_K's and Q3_K's qs)."""
    parts = values.reshape(-1, 2, 4, 32).astype(np.uint8)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]
    return (parts << shifts).sum(axis=2).astype(np.uint8).reshape(-1, 64)


def encode_q3_k(weight: np.ndarray) -> np.ndarray:
    """Q3_K blocks (110 bytes per 256 weights): 16 groups of 16 with 6-bit signed scales
    relative to fp16 `d`, values -4..3 as 2 low bits (qs) and a high bit (hmask, set for
    values >= 0)."""
    groups = weight.astype(np.float32).reshape(-1, 16, 16)
    step = np.maximum(np.abs(groups).max(axis=-1) / 4, 1e-8)
    d = (step.max(axis=-1) / 31).astype(np.float16)
    sc = np.clip(np.round(step / d.astype(np.float32)[:, None]), 1, 31).astype(np.int16)
    scale = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.round(groups / scale[..., None]), -4, 3).astype(np.int16) + 4  # 0..7
    q = q.reshape(-1, 256)
    high = (q >> 2).reshape(-1, 8, 32).astype(np.uint8)
    hmask = (high << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8)
    stored = (sc + 32).astype(np.uint8)  # [blocks, 16], 6 bits
    packed = np.zeros((stored.shape[0], 12), dtype=np.uint8)
    for j in range(16):
        packed[:, j % 8] |= ((stored[:, j] & 0x0F) << (4 * (j // 8))).astype(np.uint8)
        packed[:, 8 + j % 4] |= ((stored[:, j] >> 4) << (2 * (j // 4))).astype(np.uint8)
    blocks = np.concatenate([hmask, _pack_pairs(q & 3), packed, _f16_bytes(d)], axis=1)
    return blocks.reshape(weight.shape[0], -1)


def encode_q2_k(weight: np.ndarray) -> np.ndarray:
    """Q2_K blocks (84 bytes per 256 weights): 16 groups of 16, values 0..3, a 4-bit scale
    and min per group relative to fp16 `d` and `dmin`."""
    groups = weight.astype(np.float32).reshape(-1, 16, 16)
    low = np.minimum(groups.min(axis=-1), 0)
    step = np.maximum((groups.max(axis=-1) - low) / 3, 1e-8)
    d = (step.max(axis=-1) / 15).astype(np.float16)
    dmin = np.maximum(-low.min(axis=-1) / 15, 1e-8).astype(np.float16)
    sc = np.clip(np.round(step / d.astype(np.float32)[:, None]), 1, 15).astype(np.uint8)
    m = np.clip(np.round(-low / dmin.astype(np.float32)[:, None]), 0, 15).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.round((groups + offset[..., None]) / scale[..., None]), 0, 3)
    blocks = np.concatenate(
        [sc | (m << 4), _pack_pairs(q.reshape(-1, 256)), _f16_bytes(d), _f16_bytes(dmin)], axis=1
    )
    return blocks.reshape(weight.shape[0], -1)


_IQ4_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)


def _iq4_indices(groups: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """`[n, 32]` weights over `[n]` scales -> 16 bytes of nearest table indices each (low
    nibbles: weights 0-15)."""
    scaled = groups / np.where(scale == 0, 1, scale)[:, None]
    index = np.abs(scaled[..., None] - _IQ4_VALUES).argmin(axis=-1).astype(np.uint8)
    return index[:, :16] | (index[:, 16:] << 4)


def encode_iq4_nl(weight: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks (18 bytes per 32 weights): fp16 `d` = max|w| / 127, nearest indices."""
    groups = weight.astype(np.float32).reshape(-1, 32)
    d = (np.abs(groups).max(axis=-1) / 127).astype(np.float16)
    qs = _iq4_indices(groups, d.astype(np.float32))
    return np.concatenate([_f16_bytes(d), qs], axis=1).reshape(weight.shape[0], -1)


def encode_iq4_xs(weight: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks (136 bytes per 256 weights): fp16 `d`, a 6-bit scale per 32 (d x (ls -
    32), ls 0..63, top bit pairs in 2 bytes, low nibbles in 4), nearest indices."""
    groups = weight.astype(np.float32).reshape(-1, 8, 32)
    step = np.abs(groups).max(axis=-1) / 127
    d = np.maximum(step.max(axis=-1) / 31, 1e-8).astype(np.float16)
    ls = np.clip(np.round(step / d.astype(np.float32)[:, None]), 0, 31).astype(np.uint16) + 32
    qs = _iq4_indices(groups.reshape(-1, 32), (d.astype(np.float32)[:, None] * (ls - 32.0)).ravel())
    top = ((ls >> 4) << (2 * np.arange(8, dtype=np.uint16))).sum(axis=1).astype(np.uint16)
    low = (ls & 0x0F).astype(np.uint8)
    blocks = np.concatenate(
        [
            _f16_bytes(d),
            top.view(np.uint8).reshape(-1, 2),
            low[:, 0::2] | (low[:, 1::2] << 4),
            qs.reshape(-1, 128),
        ],
        axis=1,
    )
    return blocks.reshape(weight.shape[0], -1)


_ENCODERS = {
    Q.Q2_K: encode_q2_k,
    Q.Q3_K: encode_q3_k,
    Q.Q4_K: encode_q4_k,
    Q.Q5_K: encode_q5_k,
    Q.Q6_K: encode_q6_k,
    Q.IQ4_NL: encode_iq4_nl,
    Q.IQ4_XS: encode_iq4_xs,
}


def encode(weight: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype in _ENCODERS:
        return _ENCODERS[qtype](weight)
    return gguf.quants.quantize(weight, qtype)


def save_gguf(
    checkpoint: Path,
    path: Path,
    qtype: Q = Q.Q8_0,
    overrides: dict[str, Q] | None = None,
    architecture: str = "llama",
    config_overrides: dict | None = None,
) -> Path:
    """`checkpoint` (a llama, gemma2, gemma3 or phi3 directory) as a GGUF file: 2-D decoder
    weights in `qtype` (or `overrides[gguf name]`), everything else in F32. `config_overrides`
    change the metadata only (a file that disagrees with its tensors)."""
    original = json.loads((checkpoint / "config.json").read_text())
    config = {**original, **(config_overrides or {})}
    tensors = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(file))
    writer = gguf.GGUFWriter(str(path), architecture)
    _write_metadata(writer, config)
    _write_tokenizer(writer, checkpoint)
    heads, kv_heads = original["num_attention_heads"], original["num_key_value_heads"]
    gemma = architecture in ("gemma2", "gemma3")
    mapped = architecture in _MAPPED_ARCHITECTURES
    if architecture == "phi3":
        tensors.update(_phi3_rope_factors(writer, config))
    for hf_name, tensor in tensors.items():
        name = mapped_gguf_name(hf_name, config, architecture) if mapped else gguf_name(hf_name)
        array = tensor.to(torch.float32).numpy()
        # Gemma: norms stored as 1 + w (its RMSNorm's); its halves rotate as in transformers,
        # so q and k keep their rows (llama.cpp permutes llama's only).
        if gemma and hf_name.endswith("norm.weight"):
            array = array + 1.0
        elif not mapped and name.endswith("attn_q.weight"):
            array = llama_cpp_permute(array, heads)
        elif not mapped and name.endswith("attn_k.weight"):
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


# Architectures whose tensors the gguf package's own map (llama.cpp's) names, whose q/k rows
# llama.cpp's converter leaves as they are.
_MAPPED_ARCHITECTURES = {"gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3}
_MAPPED_ARCHITECTURES["gemma2"] = gguf.MODEL_ARCH.GEMMA2


def mapped_gguf_name(hf_name: str, config: dict, architecture: str) -> str:
    if hf_name.startswith("rope_factors_"):
        return hf_name
    arch = _MAPPED_ARCHITECTURES[architecture]
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert name is not None, hf_name
    return name


def _phi3_rope_factors(writer: gguf.GGUFWriter, config: dict) -> dict[str, torch.Tensor]:
    """Phi-3's rotary share, original context and LongRoPE factors as the converter writes
    them (the factors as tensors)."""
    rope = config.get("rope_parameters") or {}
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    writer.add_uint32(gguf.Keys.Rope.DIMENSION_COUNT.format(arch="phi3"), rotary)
    original = rope.get("original_max_position_embeddings") or config["max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("rope_type") != "longrope":
        return {}
    scale = config["max_position_embeddings"] / original
    writer.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
    )
    return {
        "rope_factors_long.weight": torch.tensor(rope["long_factor"]),
        "rope_factors_short.weight": torch.tensor(rope["short_factor"]),
    }


def _write_metadata(writer: gguf.GGUFWriter, config: dict) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // max(
        config["num_attention_heads"], 1
    )
    rope = config.get("rope_parameters") or {}
    counts = {
        gguf.Keys.LLM.CONTEXT_LENGTH: config["max_position_embeddings"],
        gguf.Keys.LLM.EMBEDDING_LENGTH: config["hidden_size"],
        gguf.Keys.LLM.BLOCK_COUNT: config["num_hidden_layers"],
        gguf.Keys.LLM.FEED_FORWARD_LENGTH: config["intermediate_size"],
        gguf.Keys.Attention.HEAD_COUNT: config["num_attention_heads"],
        gguf.Keys.Attention.HEAD_COUNT_KV: config["num_key_value_heads"],
        gguf.Keys.Attention.KEY_LENGTH: head_dim,
        gguf.Keys.Attention.VALUE_LENGTH: head_dim,
        **({} if writer.arch == "phi3" else {gguf.Keys.Rope.DIMENSION_COUNT: head_dim}),
        gguf.Keys.LLM.VOCAB_SIZE: config["vocab_size"],
    }
    for key, value in counts.items():
        _add_int(writer, key.format(arch=writer.arch), value)
    if config.get("num_local_experts"):
        writer.add_expert_count(config["num_local_experts"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if writer.arch == "gemma3":  # as the converter writes them; the global layers' RoPE
        rope = rope["full_attention"]
        writer.add_sliding_window(config["sliding_window"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if writer.arch == "gemma2":  # as the converter writes them
        writer.add_sliding_window(config["sliding_window"])
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))


def _add_int(writer: gguf.GGUFWriter, key: str, value: int) -> None:
    """As llama.cpp writes counts (uint32), or in the type a test's absurd value needs."""
    if value < 0:
        writer.add_int64(key, value)
    elif value >= 2**32:
        writer.add_uint64(key, value)
    else:
        writer.add_uint32(key, value)


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
