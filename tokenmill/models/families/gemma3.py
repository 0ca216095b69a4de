"""Gemma 3 (text): interleaved sliding-window and global layers with their own RoPE bases,
q/k norms, the sandwich of pre/post norms around attention and MLP, (1 + weight) RMSNorm,
GELU-tanh gated MLP, embeddings scaled by sqrt(hidden), query_pre_attn_scalar and optional
final logit soft-capping."""

from __future__ import annotations

from typing import Any

from tokenmill.models.config_checks import ModelLoadError
from tokenmill.models.family import Family
from tokenmill.models.traits import ArchitectureTraits

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu"}


def gemma3_traits(architecture: str, hf_config: Any) -> ArchitectureTraits:
    if getattr(hf_config, "attn_logit_softcapping", None) is not None:
        raise ModelLoadError("attention logit soft-capping (attn_logit_softcapping) is unsupported")
    activation = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
    if activation not in _ACTIVATIONS:
        raise ModelLoadError(f"Gemma hidden_activation {activation!r} is unsupported")
    window = getattr(hf_config, "sliding_window", None)
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    windows = tuple(
        int(window) if kind == "sliding_attention" and window else None for kind in layer_types
    )
    bias = bool(getattr(hf_config, "attention_bias", False))
    return ArchitectureTraits(
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=True,
        norm_offset=1.0,
        sandwich_norms=True,
        activation=_ACTIVATIONS[activation],
        embedding_scale=hf_config.hidden_size**0.5,
        attention_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
        final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
        layer_windows=windows or None,
        rope=_rope(hf_config, "full_attention", "rope_theta", 1_000_000.0),
        local_rope=_rope(hf_config, "sliding_attention", "rope_local_base_freq", 10_000.0),
    )


def _rope(hf_config: Any, layer_type: str, theta_key: str, default_theta: float) -> dict[str, Any]:
    """One layer type's RoPE settings: transformers 5 nests them by layer type; older configs
    give `rope_theta` (+ `rope_scaling`, global layers only) and `rope_local_base_freq`."""
    nested = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type in nested:
        params = dict(nested[layer_type] or {})
    elif layer_type == "full_attention":
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
    else:
        params = {}
    params.setdefault("rope_theta", getattr(hf_config, theta_key, None) or default_theta)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


FAMILY = Family(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    traits=gemma3_traits,
    gguf_architectures=("gemma3",),
)
