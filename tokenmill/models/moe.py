"""What the mixture-of-experts families share: a Llama-family decoder whose layers' MLP is a
`FusedMoE` block (layers/fused_moe.py) where the family says so, a dense MLP elsewhere.

A family (models/mixtral.py, models/qwen_moe.py) says how its config names the MoE sizes
(`moe_shape`), which layers are sparse (`is_sparse_layer`) and how its attention differs
(`architecture_traits`); the loader reads the expert tensors by their checkpoint names
(`mlp.experts.{e}.gate_proj` ...; `checkpoint_name` renames a family's own spelling).
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from tokenmill.layers.fused_moe import FusedMoE, MoEShape
from tokenmill.models.llama import ArchitectureTraits, LlamaForCausalLM

_EXPERT = re.compile(r"\.mlp\.(experts\.\d+|shared_expert)\.")


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family model with MoE blocks; the fused native decoder stack does not run it
    (its layers run as modules, the experts through the native MoE kernel where it applies)."""

    supports_fused_stack = False

    def moe_shape(self, hf_config: Any) -> MoEShape:
        raise NotImplementedError

    def is_sparse_layer(self, layer_index: int, hf_config: Any) -> bool:
        return True

    def make_mlp(
        self, layer_index: int, hf_config: Any, traits: ArchitectureTraits
    ) -> nn.Module | None:
        if not self.is_sparse_layer(layer_index, hf_config):
            return None
        return FusedMoE(self.shape.hidden_size, self.moe_shape(hf_config), self.tp)

    def intermediate_size_of(self, target: str) -> int:
        match = _EXPERT.search(target)
        if match is None:
            return self.shape.intermediate_size
        moe = self._moe_shape
        return moe.shared_expert_size if match.group(1) == "shared_expert" else moe.expert_size

    @property
    def _moe_shape(self) -> MoEShape:
        for layer in self.layers:
            if isinstance(layer.mlp, FusedMoE):
                return layer.mlp.shape
        raise ValueError("the model has no MoE layer")
