"""Random-weight EAGLE and Medusa heads for a target checkpoint, in the formats vLLM loads
(the loading-format tests and the distribution tests use them)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

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
