"""Gemma 3 (text) and Gemma 2: interleaved sliding-window and global layers, the sandwich of
pre/post norms around attention and MLP, (1 + weight) RMSNorm, GELU-tanh gated MLP, embeddings
scaled by sqrt(hidden), query_pre_attn_scalar and optional final logit soft-capping. Gemma 3
adds q/k norms and its local layers' own RoPE base; Gemma 2 soft-caps the attention's logits
(`attn_logit_softcapping`) where Gemma 3 normalises q and k."""

from __future__ import annotations

from typing import Any

from tokenmill.models.config_checks import ModelLoadError
from tokenmill.models.family import Family
from tokenmill.models.traits import ArchitectureTraits, layer_windows_of

GEMMA2 = "Gemma2ForCausalLM"
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu"}


def gemma3_traits(architecture: str, hf_config: Any) -> ArchitectureTraits:
    gemma2 = architecture == GEMMA2
    softcap = getattr(hf_config, "attn_logit_softcapping", None)
    if softcap is not None and not gemma2:
        raise ModelLoadError("attention logit soft-capping is read for Gemma 2 only")
    activation = getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh"
    if activation not in _ACTIVATIONS:
        raise ModelLoadError(f"Gemma hidden_activation {activation!r} is unsupported")
    bias = bool(getattr(hf_config, "attention_bias", False))
    return ArchitectureTraits(
        qkv_bias=bias,
        o_proj_bias=bias,
        qk_norm=not gemma2,
        norm_offset=1.0,
        sandwich_norms=True,
        activation=_ACTIVATIONS[activation],
        embedding_scale=hf_config.hidden_size**0.5,
        attention_scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
        final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
        attention_softcap=float(softcap) if softcap else None,
        layer_windows=layer_windows_of(hf_config),
        # Gemma 2: one RoPE for every layer, the config's own.
        rope=None if gemma2 else _rope(hf_config, "full_attention", "rope_theta", 1_000_000.0),
        local_rope=None
        if gemma2
        else _rope(hf_config, "sliding_attention", "rope_local_base_freq", 10_000.0),
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

GEMMA2_FAMILY = Family(
    name="gemma2",
    architectures=(GEMMA2,),
    traits=gemma3_traits,
    gguf_architectures=("gemma2",),
)
