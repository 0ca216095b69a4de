"""Where a step's flat tokens go in the paged KV cache: positions, slots, attention groups.

Shared by the model runner (the target's steps) and the draft-model proposer (its own steps
over the same block tables), so both lay out tokens the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np
import torch

from tokenmill.layers.attention.base import (
    AttentionGroup,
    AttentionMetadata,
    StepAttention,
    build_attention_group,
)

# Contexts up to this long share a group whatever their lengths; beyond it a group's contexts
# are within 2x of each other.
CONTEXT_BUCKET_TOKENS = 256


def query_length_class(query_len: int) -> int:
    """Attention groups by query length: decodes (1), draft verifications and short chunks
    (up to 16), long prefill chunks. Padding within a group then stays small."""
    return 0 if query_len == 1 else 1 if query_len <= 16 else 2


def attention_group_key(query_len: int, seq_len: int) -> tuple[int, int]:
    """Rows with equal keys are attended as one group: the same query length class, and
    contexts in the same power-of-two bucket. The portable backend pads a group's rows to its
    longest context: one row 3,500 positions deep among 32 decodes of 64 made every decode
    read 3,500 positions in every layer (steps of 4-5 s instead of ~0.4 s)."""
    return query_length_class(query_len), (seq_len // CONTEXT_BUCKET_TOKENS).bit_length()


def block_table_array(
    block_ids: Sequence[Sequence[int]], seq_lens: np.ndarray, block_size: int
) -> np.ndarray:
    """`[num_seqs, max_blocks]` block ids covering each sequence's `seq_lens` tokens."""
    num_blocks = -(-seq_lens // block_size)
    table = np.zeros((len(block_ids), int(num_blocks.max())), dtype=np.int64)
    for row, (ids, n) in enumerate(zip(block_ids, num_blocks)):
        table[row, :n] = ids[:n]
    return table


def layout_step(
    block_ids: Sequence[Sequence[int]],
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> tuple[np.ndarray, AttentionMetadata]:
    """The positions of a step's tokens and its attention metadata.

    Sequence i contributes `query_lens[i]` tokens, the last ones of its first `seq_lens[i]`;
    each run of consecutive sequences with the same `attention_group_key` is a group, so
    callers sort by it (any order is correct; sorted, the groups are fewest).
    """
    ends = np.cumsum(query_lens)
    starts = ends - query_lens
    seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    positions = np.arange(int(ends[-1])) - np.repeat(starts - (seq_lens - query_lens), query_lens)
    block_tables = block_table_array(block_ids, seq_lens, block_size)
    slot_mapping = (
        block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    )
    metadata = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, device),
        groups=lambda: _attention_groups(
            query_lens, seq_lens, block_tables, starts, block_size, sliding_window, device
        ),
    )
    if device.type == "cpu":
        metadata.step = StepAttention(
            query_start_loc=torch.from_numpy(np.append(0, ends).astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            block_tables=torch.from_numpy(block_tables),
            sliding_window=sliding_window,
        )
    return positions, metadata


def layout_decode(
    block_ids: Sequence[Sequence[int]],
    seq_lens: list[int],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> tuple[np.ndarray, AttentionMetadata]:
    """`layout_step` for a step in which every sequence adds one token (its last of
    `seq_lens[i]`): the same positions and metadata, from Python ints and two arrays.

    It runs right after the previous step's forward has streamed the weights through the
    caches, where every numpy or torch call starts cold (~0.1 ms each on a 2-vCPU Xeon VM):
    `layout_step`'s two dozen such calls cost ~0.8 ms of a 34 ms batch-1 step."""
    return layout_rows(block_ids, [1] * len(seq_lens), seq_lens, block_size, sliding_window, device)


def layout_rows(
    block_ids: Sequence[Sequence[int]],
    query_lens: list[int],
    seq_lens: list[int],
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> tuple[np.ndarray, AttentionMetadata]:
    """`layout_step` from Python ints (`layout_decode`'s way): sequence i adds the last
    `query_lens[i]` of its first `seq_lens[i]` tokens. For steps of few rows a sequence, a
    decode's or a draft verification's (k + 1), whose layout is otherwise numpy calls on
    arrays of a handful of elements."""
    num_seqs = len(seq_lens)
    num_blocks = [-(-n // block_size) for n in seq_lens]
    width = max(num_blocks)
    positions = [p for q, n in zip(query_lens, seq_lens) for p in range(n - q, n)]
    tokens = len(positions)
    ints = positions + [
        ids[p // block_size] * block_size + p % block_size
        for ids, q, n in zip(block_ids, query_lens, seq_lens)
        for p in range(n - q, n)
    ]
    for ids, n in zip(block_ids, num_blocks):
        ints += ids[:n]
        ints += [0] * (width - n)
    array = np.array(ints, dtype=np.int64)
    block_tables = array[2 * tokens :].reshape(num_seqs, width)
    query_start = list(accumulate(query_lens, initial=0))
    starts_and_lens = np.array([*query_start, *seq_lens], dtype=np.int32)
    metadata = AttentionMetadata(
        slot_mapping=to_device(array[tokens : 2 * tokens], device),
        groups=lambda: _attention_groups(
            np.array(query_lens, dtype=np.int64),
            np.array(seq_lens, dtype=np.int64),
            block_tables,
            np.array(query_start[:-1], dtype=np.int64),
            block_size,
            sliding_window,
            device,
        ),
    )
    if device.type == "cpu":
        metadata.step = StepAttention(
            query_start_loc=torch.from_numpy(starts_and_lens[: num_seqs + 1]),
            seq_lens=torch.from_numpy(starts_and_lens[num_seqs + 1 :]),
            block_tables=torch.from_numpy(block_tables),
            sliding_window=sliding_window,
        )
    return array[:tokens], metadata


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A tensor of `array` on `device`: shared with it on the CPU (no copy, no `.to` call)."""
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def _attention_groups(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    starts: np.ndarray,
    block_size: int,
    sliding_window: int | None,
    device: torch.device,
) -> list[AttentionGroup]:
    """One attention group per run of rows with the same `attention_group_key`."""
    keys = [attention_group_key(int(q), int(n)) for q, n in zip(query_lens, seq_lens)]
    cuts = [i for i in range(1, len(keys)) if keys[i] != keys[i - 1]]
    groups = []
    for first, last in zip([0, *cuts], [*cuts, len(keys)]):
        group_seq_lens = seq_lens[first:last]
        max_blocks = int(-(-group_seq_lens.max() // block_size))
        groups.append(
            build_attention_group(
                token_start=int(starts[first]),
                query_lens=torch.from_numpy(query_lens[first:last]),
                seq_lens=torch.from_numpy(group_seq_lens),
                block_tables=torch.from_numpy(
                    np.ascontiguousarray(block_tables[first:last, :max_blocks])
                ),
                block_size=block_size,
                sliding_window=sliding_window,
            )
        )
    if device.type != "cpu":
        for group in groups:
            for name in ("block_tables", "mask", "padded_index", "query_start_loc", "seq_lens"):
                value = getattr(group, name)
                if value is not None:
                    setattr(group, name, value.to(device, non_blocking=True))
    return groups
