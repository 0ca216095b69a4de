"""Mixtral: Mistral's decoder with every MLP a mixture of `num_local_experts` experts, the top
`num_experts_per_tok` per token, their softmax weights renormalised over the chosen ones."""

from __future__ import annotations

from typing import Any

from tokenmill.layers.fused_moe import MoEShape
from tokenmill.models.moe import MoEForCausalLM

# Mixtral's checkpoint spelling -> the names the MoE modules share with Qwen's.
_RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".w1.", ".gate_proj."),
    (".w3.", ".up_proj."),
    (".w2.", ".down_proj."),
)


class MixtralForCausalLM(MoEForCausalLM):
    def moe_shape(self, hf_config: Any) -> MoEShape:
        return MoEShape(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            expert_size=hf_config.intermediate_size,
            renormalize=True,
        )

    def checkpoint_name(self, name: str) -> str:
        if ".block_sparse_moe." not in name:
            return name
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name
