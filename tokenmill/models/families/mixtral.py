"""Mixtral: Mistral's decoder with every MLP a mixture of `num_local_experts` experts, the top
`num_experts_per_tok` per token, their softmax weights renormalised over the chosen ones.
llama.cpp writes it as GGUF `llama` with `llama.expert_count`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tokenmill.layers.fused_moe import MoEShape
from tokenmill.models.family import Family, TensorReader
from tokenmill.models.moe import moe_mlp
from tokenmill.models.traits import ArchitectureTraits

# Mixtral's checkpoint spelling -> the names the MoE modules share with Qwen's.
_RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


def mixtral_traits(architecture: str, hf_config: Any) -> ArchitectureTraits:
    return ArchitectureTraits()


def mixtral_moe_shape(hf_config: Any) -> MoEShape:
    return MoEShape(
        num_experts=hf_config.num_local_experts,
        top_k=hf_config.num_experts_per_tok,
        expert_size=hf_config.intermediate_size,
        renormalize=True,
    )


def rename_experts(
    name: str, read: TensorReader, hf_config: Any
) -> Iterator[tuple[str, TensorReader]]:
    """`block_sparse_moe.experts.{e}.w1/w3/w2` -> `mlp.experts.{e}.gate/up/down_proj`,
    `block_sparse_moe.gate` -> `mlp.gate`; other tensors as they are."""
    if ".block_sparse_moe." in name:
        for old, new in _RENAMES:
            name = name.replace(old, new)
    yield name, read


FAMILY = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    traits=mixtral_traits,
    gguf_architectures=("llama",),
    split_tensor=rename_experts,
    mlp=moe_mlp(mixtral_moe_shape),
    mixture_of_experts=True,
)
