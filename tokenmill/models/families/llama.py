"""Llama, Mistral, Qwen2, Qwen3: the shared decoder as it is, told apart by biases and q/k
norms."""

from __future__ import annotations

from typing import Any

from tokenmill.models.family import Family
from tokenmill.models.traits import ArchitectureTraits


def llama_traits(architecture: str, hf_config: Any) -> ArchitectureTraits:
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    if architecture == "Qwen2ForCausalLM":
        return ArchitectureTraits(qkv_bias=True)
    if architecture == "Qwen3ForCausalLM":
        return ArchitectureTraits(qkv_bias=attention_bias, o_proj_bias=attention_bias, qk_norm=True)
    if architecture == "MistralForCausalLM":
        return ArchitectureTraits()
    return ArchitectureTraits(
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
    )


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
