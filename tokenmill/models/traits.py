"""How a decoder family's members differ from the Llama layer: the switches the shared decoder
pieces (models/llama.py, models/llama_stack.py) read. A family module (models/families/)
derives them from a checkpoint's config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# MLP activations the shared gated MLP knows: silu(gate) * up, gelu_tanh(gate) * up.
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ArchitectureTraits:
    """Defaults are Llama's."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # RMSNorm scales by (norm_offset + weight): Gemma stores its weights around 0 (offset 1).
    norm_offset: float = 0.0
    # Gemma's sandwich: the attention's and the MLP's outputs are normed before the residual
    # add (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by
    # pre_feedforward_layernorm.
    sandwich_norms: bool = False
    activation: str = "silu"
    embedding_scale: float | None = None  # the embeddings are multiplied by it (Gemma)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    # The attention's scores (scaled) soft-capped the same way before the softmax (Gemma 2).
    attention_softcap: float | None = None
    # Per layer: its sliding window (None: full attention), where layers differ (Gemma 3);
    # None: the model-wide window of ModelShape.sliding_window for every layer.
    layer_windows: tuple[int | None, ...] | None = None
    # The RoPE settings (rotary.rope_parameters' form) where the config's top level does not
    # hold them (Gemma 3 nests them per layer type); None: read from the config.
    rope: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # RoPE of the layers with a window, where it differs from the others' (Gemma 3's local
    # base); None: every layer uses the model's.
    local_rope: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # Each attention head has a learned sink logit (`self_attn.sinks`) that joins its softmax
    # denominator and attends to nothing (gpt-oss).
    attention_sinks: bool = False


def layer_windows_of(hf_config: Any) -> tuple[int | None, ...] | None:
    """Each layer's sliding window from a config's `layer_types` (`sliding_attention` layers
    attend within `sliding_window`; transformers derives the types for Gemma 2/3 and for
    Qwen2/Qwen3's `use_sliding_window` with `max_window_layers`); None without layer types."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    windows = tuple(
        int(window) if kind == "sliding_attention" and window else None for kind in layer_types
    )
    return windows or None
