"""MTP drafts: the checkpoint's own multi-token-prediction layer (DeepSeek-V3, Qwen3-Next).

At position p the layer reads eh_proj([enorm(embed(t[p+1])), hnorm(h[p])]), h[p] the
target's last (post-norm) hidden state, through one full decoder layer of the target's kind
(with its input norm), and its output, normed, gives token p + 2 through the target's LM
head. Drafting k tokens chains the one layer, as vLLM does: each step reads the token it
drafted and the feature it produced (DeepSeek: the layer's output before the norm;
Qwen3-Next: after it). The proposer is EAGLE's (`eagle.EagleProposer`: catch-up over the
target's features, its own paged KV, the chain on gathered keys); only the layer differs.

Two checkpoint layouts, in the target's own directory, with `num_nextn_predict_layers` (or
`mtp_num_hidden_layers`) in its config.json:
- DeepSeek-V3: `model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.norm}.weight` and the
  decoder layer's tensors under `model.layers.{N}.`, N = num_hidden_layers;
- Qwen3-Next: `mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm}.weight` and
  `mtp.layers.0.*`.
The layer shares the target's embedding and LM head (a DeepSeek layer's `embed_tokens` and
`shared_head.head` are copies of them and are not read). The target's loader skips these
tensors (`models/mtp_names.py`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from tokenmill.kernels.argmax import argmax_rows
from tokenmill.layers.parallel import SINGLE
from tokenmill.models.llama import LlamaDecoderLayer, LlamaForCausalLM, RMSNorm
from tokenmill.spec_decode.eagle import OneLayerDraft


class MtpDraft(OneLayerDraft):
    """enorm, hnorm, eh_proj, one decoder layer of the target's kind, and the final norm; the
    target's embedding, rotary table and LM head are borrowed. `post_norm_feature`: the chain
    feeds the normed output back (Qwen3-Next), else the raw one (DeepSeek), which also zeroes
    the embedding at position 0 as vLLM's DeepSeek MTP does."""

    def __init__(self, target: LlamaForCausalLM, post_norm_feature: bool) -> None:
        shape = target.shape
        super().__init__(replace(shape, num_layers=1), target)
        self.post_norm_feature = post_norm_feature
        hidden, eps, offset = shape.hidden_size, shape.rms_norm_eps, target.traits.norm_offset
        self.enorm = RMSNorm(hidden, eps, offset)
        self.hnorm = RMSNorm(hidden, eps, offset)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(shape, target.traits, SINGLE)])
        self.norm = RMSNorm(hidden, eps, offset)

    def layer_input(
        self,
        next_ids: torch.Tensor,
        features: torch.Tensor,
        current_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's input (its residual stream) at positions p: next_ids = token p + 1,
        features = h[p] (the target's, or the chain's own)."""
        embeds = self._target[0].embed_tokens(next_ids)
        if positions is not None and not self.post_norm_feature:
            embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(features)], dim=-1))

    def attention_input(self, x: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        return self.layers[0].input_layernorm(x)

    def greedy(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the drafted token ids, the feature the next step reads) from the layer's output."""
        normed = self.norm(out)
        return argmax_rows(self.compute_logits(normed)), normed if self.post_norm_feature else out
