"""Pooling over flat hidden states: each sequence's tokens are consecutive rows of
`[num_tokens, hidden]`, so one step pools every request in a few tensor ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pool(hidden: torch.Tensor, lengths: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """`[num_seqs, hidden]`: each sequence's first token (cls), last token (last), or the
    mean of its tokens (mean), in float32."""
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    if pooling_type == "cls":
        return hidden[starts].float()
    if pooling_type == "last":
        return hidden[ends - 1].float()
    if pooling_type == "mean":
        seq_of_token = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32)
        sums.index_add_(0, seq_of_token.to(hidden.device), hidden.float())
        return sums / lengths[:, None].float()
    raise ValueError(f"unknown pooling type {pooling_type!r}")


def finish_embedding(pooled: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """An embedding as the model defines it (normalized or not), cut to `dimensions`
    (Matryoshka) and normalized again after the cut, as sentence-transformers'
    `truncate_dim` and vLLM do."""
    if dimensions is not None:
        pooled = pooled[..., :dimensions]
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled


def score_from_logits(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """A one-label classifier's score: its logit through the activation (sigmoid or none)."""
    logit = logits[..., 0].float()
    return torch.sigmoid(logit) if activation == "sigmoid" else logit
