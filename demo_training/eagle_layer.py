"""The EAGLE layer as trained (`train_heads.py`), with the checkpoint's parameter names.

Training unrolls the chain as drafting runs it (EAGLE-3's training-time test), computed
only where a loss needs it: see `EagleLayer.chain`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn


class EagleLayer(nn.Module):
    """The trainable part of the EAGLE draft, with the checkpoint's parameter names."""

    def __init__(self, config: transformers.LlamaConfig, current_token: bool = False) -> None:
        """current_token: fc also reads the embedding of token p at p (see `chain`)."""
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = h // self.num_heads
        self.fc = nn.Linear((3 if current_token else 2) * h, h, bias=False)
        attn = nn.Module()
        attn.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        attn.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        attn.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        attn.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(h, i, bias=False)
        mlp.up_proj = nn.Linear(h, i, bias=False)
        mlp.down_proj = nn.Linear(i, h, bias=False)
        layer = nn.Module()
        layer.self_attn, layer.mlp = attn, mlp
        layer.post_attention_layernorm = nn.RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([layer])

    def chain(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        doc_start: torch.Tensor,
        needed: torch.Tensor,
        num_steps: int,
        current: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """One row: the features each chain step predicts at the `needed` positions `[N]` (a
        union of runs, each ending at a trained position and reaching num_steps - 1 before it),
        `[N, H]` per step. Step j at position p continues a chain begun at p - j on the true
        features: it attends to the true features' keys up to p - j and to its own steps 1..j
        at p - j + 1 .. p, as when drafting. Only the true features' keys and values are
        computed at every position: the rest of the layer runs at the needed ones.

        embeds: `[L, H]` the embedding of token p + 1 at p; hidden: `[L, H]` the target's
        features; rope: (cos, sin) `[L, D]`; doc_start: `[L]` the row index of p's document
        start; current: `[L, H]` the embedding of token p at p, for a layer built with
        current_token (one layer cannot copy without it: the key at a prompt position j must
        say which token is at j, and the target's final features say it only in part)."""
        layer = self.layers[0]
        extra = [] if current is None else [current]
        attn, mlp = layer.self_attn, layer.mlp
        length, n = hidden.shape[0], needed.shape[0]
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rope
        x_all = self.fc(torch.cat([embeds, hidden, *extra], dim=-1))
        k_true = _rotate(attn.k_proj(x_all).view(length, kv_heads, dim), cos, sin)
        v_true = attn.v_proj(x_all).view(length, kv_heads, dim)
        k_true, v_true = _per_head(k_true, heads), _per_head(v_true, heads)  # [heads, L, D]
        cos_n, sin_n = cos[needed], sin[needed]
        key_index = torch.arange(length)
        step_keys: list[tuple[torch.Tensor, torch.Tensor]] = []  # steps 1.. at needed [heads, N, D]
        outputs: list[torch.Tensor] = []
        x = x_all[needed]
        for j in range(num_steps):
            if j:
                previous = torch.cat([hidden[needed[:1]], outputs[-1][:-1]])  # h[p] from p - 1
                x = self.fc(torch.cat([embeds[needed], previous, *(e[needed] for e in extra)], -1))
            q = _rotate(attn.q_proj(x).view(n, heads, dim), cos_n, sin_n).transpose(0, 1)
            if j:
                k = _rotate(attn.k_proj(x).view(n, kv_heads, dim), cos_n, sin_n)
                v = attn.v_proj(x).view(n, kv_heads, dim)
                step_keys.append((_per_head(k, heads), _per_head(v, heads)))
            visible = (key_index[None, :] <= needed[:, None] - j) & (
                key_index[None, :] >= doc_start[needed][:, None]
            )
            out = _attend(q, (k_true, v_true, visible), step_keys, needed, j)
            x = x + attn.o_proj(out.transpose(0, 1).reshape(n, heads * dim))
            normed = layer.post_attention_layernorm(x)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed))
            outputs.append(x)
        return outputs


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on `[L, heads, D]` with `[L, D]` tables (transformers' half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _per_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`[L, kv_heads, D]` -> `[heads, L, D]`, each KV head repeated for its query heads."""
    return x.repeat_interleave(heads // x.shape[1], dim=1).transpose(0, 1)


def _attend(
    q: torch.Tensor,
    true: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    step_keys: list[tuple[torch.Tensor, torch.Tensor]],
    needed: torch.Tensor,
    j: int,
) -> torch.Tensor:
    """Attention of chain step j's queries `[heads, N, D]` over the true features' keys and
    values `[heads, L, D]` where `visible` `[N, L]`, and over steps 1..j's own key at
    p - j + i (row r - j + i of the needed positions, where the run holds it)."""
    k_true, v_true, visible = true
    length, dim = k_true.shape[1], q.shape[-1]
    rows = torch.arange(needed.shape[0])
    scores, masks, values = [q @ k_true.transpose(1, 2)], [visible], []
    for i, (k_i, v_i) in enumerate(step_keys, start=1):
        at = (rows - j + i).clamp(min=0)
        scores.append((q * k_i[:, at]).sum(-1, keepdim=True))
        masks.append((needed[at] == needed - j + i)[:, None])
        values.append(v_i[:, at])
    logits = torch.cat(scores, dim=-1) * dim**-0.5
    logits = logits.masked_fill(~torch.cat(masks, dim=-1)[None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = probs[..., :length] @ v_true
    for i, v_i in enumerate(values):
        out = out + probs[..., length + i : length + i + 1] * v_i
    return out
