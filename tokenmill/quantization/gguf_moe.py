"""Mixture-of-experts GGUF files (gguf_file.py reads them): llama.cpp's architectures and
tensor names for Mixtral (`llama` with `llama.expert_count`), Qwen2-MoE (`qwen2moe`) and
Qwen3-MoE (`qwen3moe`), and the transformers config each becomes.

Experts are stored stacked, one tensor per projection and layer (`ffn_gate_exps`
`[experts, rows, cols]`); each expert's slice is read as its own Hugging Face tensor
(`mlp.experts.{e}.gate_proj.weight`), quantized blocks included (they run along a row). The
router's top-k weights are renormalised as llama.cpp's graphs do: Mixtral and Qwen3-MoE yes,
Qwen2-MoE no. llama.cpp's converter writes Qwen3-MoE with every layer sparse (it refuses
`mlp_only_layers`) and permutes q/k rows only for `llama` (Mixtral).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

# general.architecture -> the Hugging Face architecture of its MoE models
MOE_ARCHITECTURES = {
    "llama": "MixtralForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}
# Stacked experts: GGUF block tensor -> each expert's projection.
EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
# The other MoE-family block tensors -> Hugging Face module names.
MOE_BLOCK_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# tokenmill's MoE linears and the GGUF tensors each is made of (per expert for `exps`).
MOE_LINEAR_PARTS = {
    "mlp.experts.{e}.gate_up_proj": ("ffn_gate_exps", "ffn_up_exps"),
    "mlp.experts.{e}.down_proj": ("ffn_down_exps",),
    "mlp.shared_expert.gate_up_proj": ("ffn_gate_shexp", "ffn_up_shexp"),
    "mlp.shared_expert.down_proj": ("ffn_down_shexp",),
}
_RENORMALIZED = {"llama": True, "qwen2moe": False, "qwen3moe": True}


def is_moe(architecture: str, meta: Callable[[str, Any], Any]) -> bool:
    return architecture in MOE_ARCHITECTURES and bool(meta("expert_count", 0))


def permutes_qk(architecture: str) -> bool:
    """Whether llama.cpp's converter permuted q/k rows for its RoPE (LlamaModel only)."""
    return architecture == "llama"


def moe_hf_config(
    architecture: str,
    meta: Callable[[str, Any], Any],
    sizes: Mapping[str, int],
    common: dict[str, Any],
    has_tensor: Callable[[str], bool],
) -> Any:
    """The transformers config of an MoE GGUF file: `common` (the Llama-family fields
    gguf_file.py reads) plus the experts' (`meta(key, default)`: `<architecture>.key`)."""
    import transformers

    experts = {
        "num_experts_per_tok": int(meta("expert_used_count", None)),
        "norm_topk_prob": _RENORMALIZED[architecture],
    }
    hf_architecture = MOE_ARCHITECTURES[architecture]
    if architecture == "llama":
        config = transformers.MixtralConfig(
            **common, num_local_experts=int(meta("expert_count", None)), **experts
        )
    else:
        shared = int(meta("expert_shared_feed_forward_length", 0) or 0)
        extra: dict[str, Any] = {}
        if architecture == "qwen2moe":
            config_class = transformers.Qwen2MoeConfig
            extra = {
                "shared_expert_intermediate_size": shared,
                "qkv_bias": has_tensor("blk.0.attn_q.bias"),
            }
        else:
            config_class = transformers.Qwen3MoeConfig
        config = config_class(
            **common,
            num_experts=int(meta("expert_count", None)),
            moe_intermediate_size=int(meta("expert_feed_forward_length", None)),
            **experts,
            **extra,
        )
    config.architectures = [hf_architecture]
    return config


def moe_linear_names(
    layer: int, num_experts: int, has_tensor: Callable[[str], bool]
) -> dict[str, tuple[str, ...]]:
    """tokenmill's MoE linear names in layer `layer` -> the GGUF tensors they are made of
    (those the file holds)."""
    linears = {}
    for template, parts in MOE_LINEAR_PARTS.items():
        if not has_tensor(f"blk.{layer}.{parts[0]}.weight"):
            continue
        names = (
            [template.format(e=e) for e in range(num_experts)] if "{e}" in template else [template]
        )
        for name in names:
            linears[f"layers.{layer}.{name}"] = parts
    return linears
