"""Random-weight EAGLE and Medusa heads for a target checkpoint, in the formats vLLM loads,
and a copy of a checkpoint with a random MTP layer (the loading-format tests and the
distribution tests use them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from tokenmill.spec_decode.head_checkpoint import save_eagle, save_medusa


def _normal(generator: torch.Generator, *shape: int, std: float = 0.05) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * std


def random_eagle(target_dir: str | Path, out_dir: Path, seed: int = 0) -> Path:
    """Checkpoint names as EAGLE-1 releases write them: a `model.` prefix on some, fc with a
    bias, and the tensors vLLM ignores (input_layernorm, embed_tokens)."""
    config = transformers.AutoConfig.from_pretrained(target_dir)
    g = torch.Generator().manual_seed(seed)
    h, i = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = "model.layers.0."
    state = {
        "fc.weight": _normal(g, h, 2 * h),
        "fc.bias": _normal(g, h),
        layer + "input_layernorm.weight": torch.ones(h),
        layer + "self_attn.q_proj.weight": _normal(g, q, h),
        layer + "self_attn.k_proj.weight": _normal(g, kv, h),
        layer + "self_attn.v_proj.weight": _normal(g, kv, h),
        layer + "self_attn.o_proj.weight": _normal(g, h, q),
        layer + "post_attention_layernorm.weight": torch.ones(h),
        layer + "mlp.gate_proj.weight": _normal(g, i, h),
        layer + "mlp.up_proj.weight": _normal(g, i, h),
        layer + "mlp.down_proj.weight": _normal(g, h, i),
        "model.embed_tokens.weight": _normal(g, config.vocab_size, h),
    }
    save_eagle(state, config, out_dir, {"name": "random-eagle", "seed": seed})
    return out_dir


def random_medusa(
    target_dir: str | Path,
    out_dir: Path,
    num_heads: int = 3,
    seed: int = 0,
    original_names: bool = False,
) -> Path:
    """`original_names`: the Medusa repository's names (medusa_heads.i.0.linear, .i.1)."""
    config = transformers.AutoConfig.from_pretrained(target_dir)
    g = torch.Generator().manual_seed(seed)
    h, v = config.hidden_size, config.vocab_size
    state = {}
    for head in range(num_heads):
        block = f"medusa_heads.{head}.0.linear." if original_names else f"blocks.{head}.layers.0."
        lm_head = f"medusa_heads.{head}.1.weight" if original_names else f"lm_heads.{head}.weight"
        state[block + "weight"] = _normal(g, h, h)
        state[block + "bias"] = _normal(g, h)
        state[lm_head] = _normal(g, v, h, std=0.5)
    save_medusa(state, config, out_dir, {"name": "random-medusa", "seed": seed})
    return out_dir


def random_mtp(
    target_dir: str | Path, out_dir: Path, layout: str = "deepseek", seed: int = 0
) -> Path:
    """A copy of the target checkpoint with one random MTP layer beside its own tensors, in
    `mtp.safetensors`: DeepSeek-V3's names (`model.layers.{N}.enorm`, ..., with the copies of
    the embedding and LM head it ships) or Qwen3-Next's (`mtp.fc`, ...). eh_proj passes the
    target's feature through (plus noise), so drafts are the target's own next-token guess
    one position late: often right on a small vocabulary, which exercises acceptance."""
    shutil.copytree(target_dir, out_dir)
    config_file = out_dir / "config.json"
    config = json.loads(config_file.read_text())
    config["num_nextn_predict_layers"] = 1
    config_file.write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    layer = {
        "input_layernorm.weight": 1 + _normal(g, h),
        "self_attn.q_proj.weight": _normal(
            g,
            q,
            h,
        ),
        "self_attn.k_proj.weight": _normal(
            g,
            kv,
            h,
        ),
        "self_attn.v_proj.weight": _normal(
            g,
            kv,
            h,
        ),
        "self_attn.o_proj.weight": _normal(
            g,
            h,
            q,
        ),
        "post_attention_layernorm.weight": 1 + _normal(g, h),
        "mlp.gate_proj.weight": _normal(
            g,
            i,
            h,
        ),
        "mlp.up_proj.weight": _normal(
            g,
            i,
            h,
        ),
        "mlp.down_proj.weight": _normal(
            g,
            h,
            i,
        ),
    }
    if config.get("model_type") == "qwen3":
        layer["self_attn.q_norm.weight"] = 1 + _normal(g, head_dim)
        layer["self_attn.k_norm.weight"] = 1 + _normal(g, head_dim)
    own = {
        "enorm": 1 + _normal(g, h),
        "hnorm": 1 + _normal(g, h),
        "eh_proj": _normal(g, h, 2 * h) + torch.cat([torch.zeros(h, h), torch.eye(h)], 1),
        "norm": 1 + _normal(g, h),
    }
    if layout == "deepseek":
        prefix = f"model.layers.{config['num_hidden_layers']}."
        names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj"}
        names["norm"] = "shared_head.norm"
        v = config["vocab_size"]
        extra = {
            "embed_tokens.weight": _normal(g, v, h),
            "shared_head.head.weight": _normal(g, v, h),
        }
    elif layout == "qwen3_next":
        prefix = "mtp."
        names = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc"}
        names["norm"] = "norm"
        layer = {f"layers.0.{k}": t for k, t in layer.items()}
        extra = {}
    else:
        raise ValueError(f"unknown MTP layout {layout!r}: deepseek or qwen3_next")
    state = {f"{names[k]}.weight": t for k, t in own.items()} | layer | extra
    save_file(
        {prefix + k: t.contiguous() for k, t in state.items()}, str(out_dir / "mtp.safetensors")
    )
    return out_dir
