"""gpt-oss (`GptOssForCausalLM`): the Llama layer with biases on q/k/v/o, a learned attention
sink per head, sliding-window and full attention layers alternating as `layer_types` says,
YaRN RoPE, and every MLP gpt-oss's own mixture of experts (models/gpt_oss_moe.py: biased
router, top-k then softmax, biased experts, clamped SwiGLU), whose experts a checkpoint stores
stacked, in bfloat16 or as MXFP4 blocks (quantization/mxfp4.py). GGUF: `gpt-oss`
(quantization/gguf_gpt_oss.py). docs/moe.md, "gpt-oss"."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tokenmill.config import ConfigError
from tokenmill.layers.rotary import rope_parameters
from tokenmill.models.family import Family, TensorReader
from tokenmill.models.gpt_oss_moe import GptOssMoE, GptOssMoEShape
from tokenmill.models.traits import ArchitectureTraits

# Float checkpoints store these stacked `[experts, in, out]`; the model holds `[out, in]`.
_TRANSPOSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def gpt_oss_traits(architecture: str, hf_config: Any) -> ArchitectureTraits:
    window = getattr(hf_config, "sliding_window", None)
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    windows = tuple(
        int(window) if kind == "sliding_attention" and window else None for kind in layer_types
    )
    rope = rope_parameters(hf_config)
    rope.setdefault("max_position_embeddings", hf_config.max_position_embeddings)
    bias = bool(getattr(hf_config, "attention_bias", True))
    return ArchitectureTraits(
        qkv_bias=bias,
        o_proj_bias=bias,
        layer_windows=windows or None,
        rope=rope,
        attention_sinks=True,
    )


def is_mxfp4(hf_config: Any) -> bool:
    config = getattr(hf_config, "quantization_config", None) or {}
    if not isinstance(config, dict):
        config = config.to_dict()
    return config.get("quant_method") == "mxfp4"


def gpt_oss_mlp(
    shape: Any, traits: Any, tp: Any, layer_index: int, hf_config: Any
) -> nn.Module | None:
    if tp.size > 1:
        raise ConfigError("gpt-oss runs on one rank for now: use tensor_parallel_size 1")
    return GptOssMoE(
        GptOssMoEShape(
            hidden_size=hf_config.hidden_size,
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            expert_size=hf_config.intermediate_size,
            alpha=float(getattr(hf_config, "swiglu_alpha", 1.702)),
            limit=float(getattr(hf_config, "swiglu_limit", 7.0)),
            mxfp4=is_mxfp4(hf_config),
        )
    )


def transpose_experts(
    name: str, read: TensorReader, hf_config: Any
) -> Iterator[tuple[str, TensorReader]]:
    """A float checkpoint's stacked `[experts, in, out]` expert weights as `[experts, out,
    in]`; other tensors (MXFP4 blocks and scales are `[out, ...]` already) as they are."""
    if not name.endswith(_TRANSPOSED):
        yield name, read
        return

    def read_transposed(rank: Any) -> torch.Tensor:
        return read(rank).transpose(1, 2).contiguous()

    yield name, read_transposed


FAMILY = Family(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    traits=gpt_oss_traits,
    gguf_architectures=("gpt-oss",),
    split_tensor=transpose_experts,
    mlp=gpt_oss_mlp,
    mixture_of_experts=True,
)
