"""Qwen3.5 GGUF files (`general.architecture` `qwen35`, as llama.cpp's converter writes them
with `--no-mtp`): their tensor names, their config, and what the converter changed taken back
so the tensors are the checkpoint's again (models/hybrid.py loads them as it loads
safetensors):

- every RMSNorm but the linear layers' gated one stored as `1 + weight` (minus 1 here);
- `A_log` stored as `ssm_a = -exp(A_log)` (log(-a) here);
- the linear layers' value heads stored tiled across key heads ([v0 of every key head, v1 of
  every key head, ...]) instead of grouped by key head: put back in v's rows of `attn_qkv`
  and the conv, `attn_gate`'s rows, `ssm_alpha` / `ssm_beta` / `ssm_a` / `ssm_dt`'s heads and
  `ssm_out`'s columns.

A quantized linear keeps its blocks (the int8 / int4 groups llama GGUF files load into,
`LINEAR_PARTS`): the regrouping of value heads moves whole rows (exact), and `ssm_out`'s
columns move in whole groups where a value head spans whole groups (else that one linear is
dequantized). Qwen3-Next (`qwen3next`) and Qwen3.5-MoE files are not read yet.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tokenmill.quantization.gguf_sizes import sized_fields

ARCHITECTURE = "qwen35"
HF_ARCHITECTURE = "Qwen3_5ForCausalLM"
# GGUF block tensor (with its suffix) -> the name after `model.layers.<i>.` that the model
# loads (the checkpoint's, the gated attention's q/k/v as `split_hybrid_tensor` renames them).
NAMES = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "attn_q.weight": "self_attn.q_gate_proj.weight",
    "attn_k.weight": "self_attn.key_proj.weight",
    "attn_v.weight": "self_attn.value_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)$")
# tokenmill's linears (after `layers.<i>.`) and the GGUF tensors each is made of; a layer has
# the linear-attention ones or the full-attention ones.
LINEAR_PARTS = {
    "linear_attn.in_proj_qkv": ("attn_qkv",),
    "linear_attn.in_proj_z": ("attn_gate",),
    "linear_attn.in_proj_a": ("ssm_alpha",),
    "linear_attn.in_proj_b": ("ssm_beta",),
    "linear_attn.out_proj": ("ssm_out",),
    "self_attn.q_gate_proj": ("attn_q",),
    "self_attn.key_proj": ("attn_k",),
    "self_attn.value_proj": ("attn_v",),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def hf_name(name: str) -> str | None:
    match = _BLOCK.match(name)
    if match is None or match.group(2) not in NAMES:
        return None
    return f"model.layers.{match.group(1)}.{NAMES[match.group(2)]}"


def hf_config(
    sizes: Mapping[str, int],
    meta: Callable[..., Any],
    tied: bool,
    token_ids: Mapping[str, Any],
) -> Any:
    """A transformers Qwen3_5TextConfig from the metadata (`meta(key, default)` reads
    `qwen35.<key>`) and the checked sizes."""
    from transformers import Qwen3_5TextConfig

    value_heads = int(meta("ssm.time_step_rank"))
    recurrent = list(meta("attention.recurrent_layers"))
    config = Qwen3_5TextConfig(
        **sized_fields(sizes, meta),
        layer_types=["linear_attention" if r else "full_attention" for r in recurrent],
        linear_conv_kernel_dim=int(meta("ssm.conv_kernel")),
        linear_key_head_dim=int(meta("ssm.state_size")),
        linear_num_key_heads=int(meta("ssm.group_count")),
        linear_num_value_heads=value_heads,
        linear_value_head_dim=int(meta("ssm.inner_size")) // value_heads,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(meta("rope.freq_base")),
            "partial_rotary_factor": int(meta("rope.dimension_count")) / sizes["head_dim"],
        },
        tie_word_embeddings=tied,
        **token_ids,
    )
    config.architectures = [HF_ARCHITECTURE]
    return config


def norm_shift(hf_name: str) -> float:
    """What the converter added to a float tensor: 1 to every norm but the gated one."""
    norm = hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight")
    return 1.0 if norm else 0.0


def restore(hf_name: str, weight: torch.Tensor, meta: Callable[..., Any]) -> torch.Tensor:
    """The checkpoint's tensor from the file's (float, rows first, shift taken off)."""
    if hf_name.endswith(".A_log"):
        weight = torch.log(-weight)
    if hf_name.endswith(".conv1d.weight"):
        weight = weight.reshape(weight.shape[0], 1, -1)
    k_heads, v_heads = int(meta("ssm.group_count")), int(meta("ssm.time_step_rank"))
    if ".linear_attn." not in hf_name or k_heads == v_heads:
        return weight
    grouped = _grouped(k_heads, v_heads // k_heads)
    v_dim = int(meta("ssm.inner_size")) // v_heads
    key_rows = 2 * int(meta("ssm.state_size")) * k_heads
    if hf_name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        return torch.cat([weight[:key_rows], grouped(weight[key_rows:], 0, v_dim)])
    if hf_name.endswith(".in_proj_z.weight"):
        return grouped(weight, 0, v_dim)
    if hf_name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return grouped(weight, 0, 1)
    if hf_name.endswith(".out_proj.weight"):
        return grouped(weight, 1, v_dim)
    return weight


def columns_regroup_whole(meta: Callable[..., Any], group_size: int) -> bool:
    """Whether `ssm_out`'s columns regroup in whole quantization groups: no regrouping (as
    many value heads as key heads), or each value head a whole number of groups."""
    k_heads, v_heads = int(meta("ssm.group_count")), int(meta("ssm.time_step_rank"))
    v_dim = int(meta("ssm.inner_size")) // v_heads
    return k_heads == v_heads or v_dim % group_size == 0


def restore_quantized(hf_name: str, weight: Any, meta: Callable[..., Any]) -> Any:
    """`restore` for a quantized linear's groups (`Int8GroupWeight` / `Int4GroupWeight`):
    the same row order (exact), `out_proj`'s columns moved a group at a time (the caller
    checked `columns_regroup_whole`)."""
    if ".linear_attn." not in hf_name or meta("ssm.group_count") == meta("ssm.time_step_rank"):
        return weight
    rows, cols = weight.shape
    if hf_name.endswith(".out_proj.weight"):
        return _permute_column_groups(weight, restore(hf_name, torch.arange(cols)[None], meta)[0])
    return weight.permute_rows(restore(hf_name, torch.arange(rows)[:, None], meta)[:, 0])


def _permute_column_groups(weight: Any, order: torch.Tensor) -> Any:
    """Columns in `order` (whole groups of `weight.group_size`, each kept in sequence)."""
    size = weight.group_size
    group_order = order[::size] // size
    expected = (group_order[:, None] * size + torch.arange(size)).flatten()
    if not torch.equal(expected, order):
        raise ValueError("a column order that splits quantization groups")
    moved = {}
    for field in dataclasses.fields(weight):
        tensor = getattr(weight, field.name)
        if tensor is None:
            moved[field.name] = None
        elif tensor.shape[1] == order.shape[0]:
            moved[field.name] = tensor[:, order].contiguous()
        else:
            moved[field.name] = tensor[:, group_order].contiguous()
    return type(weight)(**moved)


def _grouped(k_heads: int, per_k: int) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
    """Value heads tiled across key heads ([per_k, k_heads, dim] along `dim`) back to grouped
    by key head ([k_heads, per_k, dim]): the converter's `_reorder_v_heads` undone."""

    def regroup(tensor: torch.Tensor, axis: int, head_dim: int) -> torch.Tensor:
        shape = list(tensor.shape)
        tiled = tensor.reshape(*shape[:axis], per_k, k_heads, head_dim, *shape[axis + 1 :])
        return tiled.transpose(axis, axis + 1).reshape(shape).contiguous()

    return regroup
