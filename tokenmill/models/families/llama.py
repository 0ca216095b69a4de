"""Llama, Mistral, Qwen2, Qwen3: the shared decoder as it is, told apart by biases and q/k
norms."""

from __future__ import annotations

from typing import Any

from tokenmill.models.family import Family
from tokenmill.models.traits import ArchitectureTraits, layer_windows_of


def llama_traits(architecture: str, hf_config: Any) -> ArchitectureTraits:
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    if architecture == "Qwen2ForCausalLM":
        return ArchitectureTraits(qkv_bias=True, layer_windows=_qwen_windows(hf_config))
    if architecture == "Qwen3ForCausalLM":
        return ArchitectureTraits(
            qkv_bias=attention_bias,
            o_proj_bias=attention_bias,
            qk_norm=True,
            layer_windows=_qwen_windows(hf_config),
        )
    if architecture == "MistralForCausalLM":
        return ArchitectureTraits()
    return ArchitectureTraits(
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
    )


def _qwen_windows(hf_config: Any) -> tuple[int | None, ...] | None:
    """Qwen2/Qwen3's `use_sliding_window`: the layers from `max_window_layers` on attend
    within the window (transformers' `layer_types`), served as per-layer windows (their KV
    behind it freed where full-attention layers remain: layers/kv_groups.py)."""
    if not getattr(hf_config, "use_sliding_window", False):
        return None
    windows = layer_windows_of(hf_config)
    return windows if windows and any(w is not None for w in windows) else None


FAMILY = Family(
    name="llama",
    architectures=(
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ),
    traits=llama_traits,
    gguf_architectures=("llama",),
)
