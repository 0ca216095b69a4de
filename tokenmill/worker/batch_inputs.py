"""The flat tensors of the batch the model runner runs in one engine step (`BatchInputs`),
and the lean path for a decode-only step."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import numpy as np
import torch

from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.step.layout import layout_decode, layout_rows, to_device
from tokenmill.step.runner_request_state import CachedRequestState
from tokenmill.structured_output.bitmask import GrammarBitmask, apply_grammar_bitmask
from tokenmill.worker.captured_step import DecodeBatch


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata | None  # None for a captured decode step
    # Rows of the hidden states to compute logits for; None: the first len(sampling_states)
    # rows, in order (a step whose every token samples: no index op).
    logits_indices: torch.Tensor | None
    sampling_states: list[CachedRequestState]  # the requests those rows belong to
    sampling_drafts: list[list[int]]  # per sampling request: drafts verified (k + 1 rows)
    prompt_logprob_rows: list[tuple[CachedRequestState, int, int]]  # (state, first row, count)
    # Per scheduled request, in row order: its first row, first position, end of known tokens.
    states: list[CachedRequestState]
    row_starts: list[int]
    first_positions: list[int]
    known_ends: list[int]
    decode: DecodeBatch | None = None  # a decode-only step that runs captured


def all_decode(states: list[CachedRequestState], num_scheduled: dict[str, int]) -> bool:
    """Every request computes one token, its last known one, and samples the next, without
    prompt logprobs (a one-token prompt chunk with more prompt to come does not sample)."""
    return all(
        num_scheduled[s.req_id] == 1
        and s.num_computed_tokens + 1 == len(s.token_ids)
        and s.sampling_params.prompt_logprobs is None
        for s in states
    )


def decode_inputs(
    states: list[CachedRequestState],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> BatchInputs:
    """Inputs of a step in which every request computes its last token and samples the
    next (`all_decode`): built from Python ints, with a handful of array calls, since
    each call runs cold after the previous forward (`layout_decode`)."""
    seq_lens = [len(s.token_ids) for s in states]
    positions, metadata = layout_decode(
        [s.block_ids for s in states],
        seq_lens,
        block_size,
        sliding_window,
        device,
    )
    input_ids = np.array([s.token_ids[-1] for s in states], dtype=np.int64)
    return BatchInputs(
        input_ids=to_device(input_ids, device),
        positions=to_device(positions, device),
        metadata=metadata,
        logits_indices=None,
        sampling_states=states,
        sampling_drafts=[[] for _ in states],
        prompt_logprob_rows=[],
        states=states,
        row_starts=list(range(len(states))),
        first_positions=[n - 1 for n in seq_lens],
        known_ends=seq_lens,
    )


def verify_inputs(
    runner: Any,
    states: list[CachedRequestState],
    num_scheduled: dict[str, int],
    drafts: list[list[int]],
) -> BatchInputs | None:
    """Inputs of a step of verifications only, from Python ints as a decode's
    (`decode_inputs`): every request computes its last known token and the drafts after it
    and samples every row, without prompt logprobs, on the CPU, not captured. At batch 1 the
    general path's numpy calls on arrays of k + 1 elements cost more than the rest of the
    step's bookkeeping. None where the step is not one of those (`runner`: the model
    runner, for its block size, window, KV groups, device and captured step)."""
    if runner.device.type != "cpu" or runner.decode_step is not None:
        return None
    for s, d in zip(states, drafts):
        if num_scheduled[s.req_id] != 1 + len(d) or s.num_computed_tokens + 1 != len(s.token_ids):
            return None
        if s.sampling_params.prompt_logprobs is not None:
            return None
    query_lens = [1 + len(d) for d in drafts]
    seq_lens = [len(s.token_ids) + len(d) for s, d in zip(states, drafts)]
    cpu = runner.device

    def layout(block_ids: list[list[int]]) -> tuple[np.ndarray, AttentionMetadata]:
        window = runner.sliding_window
        return layout_rows(block_ids, query_lens, seq_lens, runner.block_size, window, cpu)

    positions, metadata = layout([s.block_ids for s in states])
    if runner.kv_groups is not None:  # a hybrid cache: the same rows through each group's
        metadata.kv_groups = [
            layout([s.group_block_ids[group] for s in states])[1]
            for group in range(len(runner.kv_groups.windows) - 1)
        ]
    input_ids = np.array([t for s, d in zip(states, drafts) for t in (s.token_ids[-1], *d)])
    return BatchInputs(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        metadata=metadata,
        logits_indices=torch.arange(len(positions)),
        sampling_states=states,
        sampling_drafts=drafts,
        prompt_logprob_rows=[],
        states=states,
        row_starts=list(accumulate(query_lens[:-1], initial=0)),
        first_positions=[len(s.token_ids) - 1 for s in states],
        known_ends=[len(s.token_ids) for s in states],
    )


def apply_grammar(logits: torch.Tensor, grammar: GrammarBitmask, inputs: BatchInputs) -> None:
    """Mask the logits of constrained rows: a request sampling k drafts + 1 has k + 1 rows."""
    logit_rows: list[int] = []
    bitmask_rows: list[int] = []
    row = 0
    for state, drafts in zip(inputs.sampling_states, inputs.sampling_drafts):
        first = grammar.first_rows.get(state.req_id)
        if first is not None:
            logit_rows.extend(range(row, row + len(drafts) + 1))
            bitmask_rows.extend(range(first, first + len(drafts) + 1))
        row += len(drafts) + 1
    apply_grammar_bitmask(logits, grammar.bitmask, logit_rows, bitmask_rows)


def captured_inputs(
    decode: DecodeBatch,
    states: list[CachedRequestState],
    computed: np.ndarray,
    known_ends: list[int],
    device: torch.device,
) -> BatchInputs:
    """A captured decode step's inputs go to its key's static buffers, not to tensors."""
    return BatchInputs(
        input_ids=torch.from_numpy(decode.token_ids),
        positions=torch.from_numpy(decode.seq_lens - 1),
        metadata=None,
        logits_indices=torch.arange(len(states), device=device),
        sampling_states=states,
        sampling_drafts=[[] for _ in states],
        prompt_logprob_rows=[],
        states=states,
        row_starts=list(range(len(states))),
        first_positions=computed.tolist(),
        known_ends=known_ends,
        decode=decode,
    )
