"""Qwen2-MoE and Qwen3-MoE: Qwen2's / Qwen3's attention with MoE blocks in the layers
`decoder_sparse_step` picks, minus `mlp_only_layers` (dense MLPs of `intermediate_size`).
Qwen2-MoE adds a shared expert scaled by a sigmoid gate to every MoE block and keeps the
top-k softmax weights as they are (`norm_topk_prob` false); Qwen3-MoE renormalises them
(`norm_topk_prob` true in its checkpoints). GGUF: `qwen2moe`, `qwen3moe`."""

from __future__ import annotations

from typing import Any

from tokenmill.layers.fused_moe import MoEShape
from tokenmill.models.family import Family
from tokenmill.models.moe import moe_mlp
from tokenmill.models.traits import ArchitectureTraits


def qwen_moe_traits(architecture: str, hf_config: Any) -> ArchitectureTraits:
    if architecture == "Qwen2MoeForCausalLM":
        return ArchitectureTraits(qkv_bias=bool(getattr(hf_config, "qkv_bias", True)))
    bias = bool(getattr(hf_config, "attention_bias", False))
    return ArchitectureTraits(qkv_bias=bias, o_proj_bias=bias, qk_norm=True)


def qwen_moe_shape(hf_config: Any) -> MoEShape:
    return MoEShape(
        num_experts=hf_config.num_experts,
        top_k=hf_config.num_experts_per_tok,
        expert_size=hf_config.moe_intermediate_size,
        renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
        shared_expert_size=getattr(hf_config, "shared_expert_intermediate_size", 0) or 0,
    )


def is_sparse_layer(layer_index: int, hf_config: Any) -> bool:
    """As transformers decides it (Qwen2MoeDecoderLayer, Qwen3MoeDecoderLayer)."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return (
        layer_index not in (getattr(hf_config, "mlp_only_layers", None) or [])
        and hf_config.num_experts > 0
        and (layer_index + 1) % step == 0
    )


FAMILY = Family(
    name="qwen_moe",
    architectures=("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"),
    traits=qwen_moe_traits,
    gguf_architectures=("qwen2moe", "qwen3moe"),
    mlp=moe_mlp(qwen_moe_shape, is_sparse_layer),
    mixture_of_experts=True,
)
