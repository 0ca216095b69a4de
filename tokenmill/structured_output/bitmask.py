"""The runner's side: one batched application of a step's grammar bitmask to the logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GrammarBitmask:
    """Allowed tokens per constrained row of a step, packed 32 to an int32 (bit set: allowed).
    A request's rows start at `first_rows[req_id]`: one per token it samples this step."""

    bitmask: torch.Tensor  # [rows, ceil(vocab / 32)] int32, on the CPU
    first_rows: dict[str, int]


def apply_grammar_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, logit_rows: list[int], bitmask_rows: list[int]
) -> None:
    """Set to -inf, in place, the logits of tokens the grammar forbids, in one operation over
    every constrained row (`logit_rows[i]` takes `bitmask[bitmask_rows[i]]`)."""
    import xgrammar as xgr

    if logit_rows == bitmask_rows and bitmask.shape[0] == logits.shape[0]:
        aligned = bitmask
    else:  # -1: every token allowed, for the rows left unconstrained
        aligned = bitmask.new_full((logits.shape[0], bitmask.shape[1]), -1)
        aligned[logit_rows] = bitmask[bitmask_rows]
    xgr.apply_token_bitmask_inplace(
        logits, aligned.to(logits.device, non_blocking=True), indices=logit_rows
    )
