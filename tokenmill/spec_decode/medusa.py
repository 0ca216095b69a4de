"""Medusa drafts: k heads on the target's last hidden state, head i guessing token n + i.

Each head is residual SiLU blocks and an LM head of its own; from the (post-norm) hidden
state of the row the last token was sampled from, head i proposes the token i + 1 places
after it. The heads need no KV and no loop: all of them run as two batched matmuls per
block plus one for the LM heads, whatever k is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.spec_decode.proposer import proposal_threads

if TYPE_CHECKING:
    from tokenmill.step.runner_request_state import CachedRequestState


class MedusaHeads(nn.Module):
    """vLLM's `MedusaModel` parameters (`blocks.i.layers.j`, `lm_heads.i`); after loading,
    `stack()` packs them into `[heads, ...]` tensors for batched matmuls."""

    def __init__(
        self, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int, bias: bool
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.blocks = nn.ModuleList()
        for _ in range(num_heads):
            block = nn.Module()
            block.layers = nn.ModuleList(
                nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers)
            )
            self.blocks.append(block)
        self.lm_heads = nn.ModuleList(
            nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads)
        )
        self.block_weights: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.head_weights = torch.empty(0)

    def stack(self) -> None:
        self.eval().requires_grad_(False)
        self.block_weights = []
        for j in range(len(self.blocks[0].layers) if self.num_heads else 0):
            layers = [block.layers[j] for block in self.blocks]
            weight = torch.stack([layer.weight.transpose(0, 1) for layer in layers])
            bias = None if layers[0].bias is None else torch.stack([la.bias for la in layers])
            self.block_weights.append((weight, None if bias is None else bias[:, None, :]))
        self.head_weights = torch.stack([h.weight.transpose(0, 1) for h in self.lm_heads])

    def forward(self, hidden: torch.Tensor, num_heads: int) -> torch.Tensor:
        """Greedy tokens `[rows, num_heads]` from hidden states `[rows, hidden_size]`."""
        x = hidden.unsqueeze(0).expand(num_heads, -1, -1)  # [heads, rows, hidden]
        for weight, bias in self.block_weights:
            y = torch.bmm(x, weight[:num_heads])
            if bias is not None:
                y = y + bias[:num_heads]
            x = x + F.silu(y)
        logits = torch.bmm(x, self.head_weights[:num_heads])  # [heads, rows, vocab]
        return logits.argmax(dim=-1).transpose(0, 1)


class MedusaProposer:
    def __init__(self, heads: MedusaHeads) -> None:
        self.heads = heads
        self.proposal_threads = proposal_threads(sum(p.numel() for p in heads.parameters()))

    def record_hidden_states(
        self, state: CachedRequestState, first_position: int, hidden: torch.Tensor
    ) -> None:
        """Only the last row matters: the one the request's newest token was sampled from."""
        if hidden.shape[0]:
            state.draft_hidden = [(first_position + hidden.shape[0] - 1, hidden[-1:])]

    @torch.inference_mode()
    def propose(self, states: list[CachedRequestState], num_tokens: int) -> dict[str, list[int]]:
        ready = [
            s for s in states if s.draft_hidden and s.draft_hidden[0][0] == len(s.token_ids) - 2
        ]
        if not ready or num_tokens <= 0:
            return {}
        hidden = torch.cat([s.draft_hidden[0][1] for s in ready])
        tokens = self.heads(hidden, min(num_tokens, self.heads.num_heads)).tolist()
        return {s.req_id: row for s, row in zip(ready, tokens)}
