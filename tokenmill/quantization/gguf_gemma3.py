"""Gemma 3 and Gemma 2 GGUF files (`general.architecture` `gemma3`, `gemma2`, as llama.cpp's
converter writes them): their tensor names, their config, and the norms' stored `1 + weight`
taken back to the checkpoint's `weight` (the model adds the 1 again: exact for weights near 0).

llama.cpp fixes what the file does not say, and so does this reader: every sixth layer
attends globally, the others within `gemma3.attention.sliding_window` with RoPE base 10000,
and queries are scaled by 1/sqrt(head_dim) (query_pre_attn_scalar = head_dim; Gemma 3 27B's
hidden/heads is not told apart either). Gemma 2 as llama.cpp reads it: even layers local, odd
ones global, one RoPE base (10000 where the file has none), attention logits soft-capped at
`gemma2.attn_logit_softcapping`, queries scaled by 1/sqrt(head_dim) except 27B's (46 layers:
1/sqrt(hidden/heads))."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tokenmill.quantization.gguf_sizes import sized_fields

ARCHITECTURE = "gemma3"
HF_ARCHITECTURE = "Gemma3ForCausalLM"
GEMMA2_ARCHITECTURE = "gemma2"
ARCHITECTURES = (GEMMA2_ARCHITECTURE, ARCHITECTURE)  # whose norms llama.cpp stores as 1 + w
SLIDING_WINDOW_PATTERN = 6  # llama.cpp's: layer i is global where (i + 1) % 6 == 0
LOCAL_ROPE_THETA = 10_000.0
# GGUF block tensor -> Hugging Face module (llama's names where they agree).
NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def hf_config(
    sizes: Mapping[str, int],
    meta: Callable[..., Any],
    tied: bool,
    token_ids: Mapping[str, Any],
) -> Any:
    """A transformers Gemma3TextConfig from the metadata (`meta(key, default)` reads
    `gemma3.<key>`) and the checked sizes."""
    from transformers import Gemma3TextConfig

    layers = sizes["num_layers"]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base"))}
    if meta("rope.scaling.type", "none") == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    config = Gemma3TextConfig(
        **sized_fields(sizes, meta),
        sliding_window=int(meta("attention.sliding_window")),
        layer_types=[
            "full_attention" if (i + 1) % SLIDING_WINDOW_PATTERN == 0 else "sliding_attention"
            for i in range(layers)
        ],
        rope_parameters={
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_THETA},
        },
        query_pre_attn_scalar=sizes["head_dim"],
        final_logit_softcapping=meta("final_logit_softcapping", 0.0) or None,
        tie_word_embeddings=tied,
        **token_ids,
    )
    config.architectures = [HF_ARCHITECTURE]
    return config


def gemma2_hf_config(
    sizes: Mapping[str, int],
    meta: Callable[..., Any],
    tied: bool,
    token_ids: Mapping[str, Any],
) -> Any:
    """A transformers Gemma2Config from the metadata (`meta(key, default)` reads
    `gemma2.<key>`) and the checked sizes."""
    from transformers import Gemma2Config

    layers, head_dim = sizes["num_layers"], sizes["head_dim"]
    config = Gemma2Config(
        **sized_fields(sizes, meta),
        sliding_window=int(meta("attention.sliding_window", 4096)),
        layer_types=[
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
        rope_parameters={"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 1e4))},
        query_pre_attn_scalar=sizes["hidden_size"] // sizes["num_heads"]
        if layers == 46
        else head_dim,
        attn_logit_softcapping=meta("attn_logit_softcapping", 0.0) or None,
        final_logit_softcapping=meta("final_logit_softcapping", 0.0) or None,
        tie_word_embeddings=tied,
        **token_ids,
    )
    config.architectures = ["Gemma2ForCausalLM"]
    return config


def norm_shift(hf_name: str) -> float:
    """What llama.cpp's converter added to a tensor (1 to every norm: Gemma's RMSNorm scales
    by 1 + weight); the reader takes it off."""
    return 1.0 if hf_name.endswith("norm.weight") else 0.0
