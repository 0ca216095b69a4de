"""What the mixture-of-experts families (models/families/mixtral.py, qwen_moe.py) share: a
Llama-family decoder whose layers' MLP is a `FusedMoE` block (layers/fused_moe.py) where the
family says so, a dense MLP elsewhere.

A family gives `moe_mlp` how its config names the MoE sizes and which layers are sparse; the
loader reads the expert tensors by their checkpoint names (`mlp.experts.{e}.gate_proj` ...;
a family's `split_tensor` renames its own spelling). The fused native decoder stack runs these
models where every MoE block has routed experts only, each with a native product
(llama_stack.py: router, routing and the experts' phases inside the stack's one job, steps of
up to `ONE_JOB_MAX_PAIRS` pairs); elsewhere (a shared expert, a larger step) the layers run as
modules, the experts through the native MoE kernel where it applies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from tokenmill.layers.fused_moe import FusedMoE, MoEShape
from tokenmill.models.family import MlpBuilder


def moe_mlp(
    moe_shape: Callable[[Any], MoEShape],
    is_sparse_layer: Callable[[int, Any], bool] = lambda layer_index, hf_config: True,
) -> MlpBuilder:
    """The family's `Family.mlp`: a `FusedMoE` of `moe_shape(hf_config)` in the layers
    `is_sparse_layer(layer_index, hf_config)` picks, the dense MLP (None) in the others."""

    def build(
        shape: Any, traits: Any, tp: Any, layer_index: int, hf_config: Any
    ) -> nn.Module | None:
        if not is_sparse_layer(layer_index, hf_config):
            return None
        return FusedMoE(shape.hidden_size, moe_shape(hf_config), tp)

    return build
