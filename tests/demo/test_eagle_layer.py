"""The EAGLE layer as trained computes, at every needed position and chain step, what drafting
computes: the chain begun j positions back on the target's features, recomputed from scratch
(plain causal attention over the document, no gathering or hand-written masks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from demo_training.eagle_layer import EagleLayer


def _drafted(
    layer: EagleLayer, embeds, hidden, rope, start: int, chain_start: int, j: int, current=None
):
    """The layer's output at chain_start + j of a chain begun at chain_start (true features up
    to there, then its own predictions), over the document beginning at `start`."""
    block = layer.layers[0]
    attn, mlp = block.self_attn, block.mlp
    heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    features = hidden[start : chain_start + 1]
    for _ in range(j + 1):
        n = features.shape[0]
        inputs = [embeds[start : start + n], features]
        if current is not None:
            inputs.append(current[start : start + n])
        x = layer.fc(torch.cat(inputs, -1))
        cos, sin = (t[start : start + n][None] for t in rope)
        q, k, v = (
            proj(x).view(1, n, h, dim).transpose(1, 2)
            for proj, h in ((attn.q_proj, heads), (attn.k_proj, kv_heads), (attn.v_proj, kv_heads))
        )
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(n, -1))
        normed = block.post_attention_layernorm(x)
        x = x + mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed))
        features = torch.cat([features, x[-1:]])
    return x[-1]


@pytest.mark.parametrize("current_token", [False, True])
def test_training_chain_is_the_drafting_chain(current_token: bool) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2
    )
    layer = EagleLayer(config, current_token)
    pos = torch.cat([torch.arange(12), torch.arange(20)])  # two documents in one row
    length = pos.shape[0]
    doc_start = torch.where(pos == 0, torch.arange(length), 0).cummax(0).values
    hidden, embeds = torch.randn(length, 32), torch.randn(length, 32)
    current = torch.randn(length, 32) if current_token else None
    cos, sin = LlamaRotaryEmbedding(config)(hidden[None], pos[None])
    rope = (cos[0], sin[0])
    # Runs of needed positions, as the trainer makes them (each reaching 2 before a trained
    # position), one across the documents' boundary.
    needed = torch.tensor([2, 3, 4, 5, 9, 10, 11, 12, 13, 14, 22, 23, 24, 25, 26])
    with torch.no_grad():
        outputs = layer.chain(embeds, hidden, rope, doc_start, needed, 3, current)
        checked = 0
        for row, p in enumerate(needed.tolist()):
            for j, out in enumerate(outputs):
                begun = p - j
                if begun < doc_start[p] or any(q not in needed for q in range(begun, p + 1)):
                    continue  # not a chain the trainer takes a loss on
                start = int(doc_start[p])
                want = _drafted(layer, embeds, hidden, rope, start, begun, j, current)
                torch.testing.assert_close(out[row], want, rtol=1e-4, atol=1e-4)
                checked += 1
    assert checked > 20
