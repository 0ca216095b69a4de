"""Phi-3 / Phi-4-mini GGUF files (`general.architecture` `phi3`, as llama.cpp's converter writes
them): q/k/v fused in `attn_qkv` and gate/up in `ffn_up` (loaded whole into tokenmill's fused
linears), the rotated share of each head in `phi3.rope.dimension_count`, LongRoPE's factors as
the tensors `rope_factors_long` / `rope_factors_short` (read into the config, not the model)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tokenmill.quantization.gguf_sizes import sized_fields

ARCHITECTURE = "phi3"
HF_ARCHITECTURE = "Phi3ForCausalLM"
NAMES = {
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# tokenmill's fused linears and the GGUF tensor each is.
LINEAR_PARTS = {
    "self_attn.qkv_proj": ("attn_qkv",),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_up",),
    "mlp.down_proj": ("ffn_down",),
}
# Tensors that are settings, not weights.
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def hf_config(
    sizes: Mapping[str, int],
    meta: Callable[..., Any],
    tied: bool,
    token_ids: Mapping[str, Any],
    read_factors: Callable[[str], list[float] | None],
) -> Any:
    """A transformers Phi3Config from the metadata (`meta(key, default)` reads `phi3.<key>`),
    the checked sizes and the LongRoPE factor tensors (`read_factors(name)`, None if absent)."""
    from transformers import Phi3Config

    head_dim = sizes["head_dim"]
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(meta("rope.freq_base")),
        "partial_rotary_factor": int(meta("rope.dimension_count", head_dim)) / head_dim,
    }
    original = int(meta("rope.scaling.original_context_length", sizes["max_position"]))
    long, short = (read_factors(name) for name in ROPE_FACTORS)
    if long is not None and short is not None:
        rope.update(rope_type="longrope", long_factor=long, short_factor=short)
        rope["original_max_position_embeddings"] = original
        attention_factor = meta("rope.scaling.attn_factor", 0.0)
        if attention_factor:
            rope["attention_factor"] = float(attention_factor)
    config = Phi3Config(
        **sized_fields(sizes, meta),
        original_max_position_embeddings=original,
        sliding_window=int(meta("attention.sliding_window", 0)) or None,
        rope_parameters=rope,
        tie_word_embeddings=tied,
        **token_ids,
    )
    config.architectures = [HF_ARCHITECTURE]
    return config
