"""Attention groups of a step: rows whose contexts differ by far are not padded together."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.attention import torch_backend
from tokenmill.layers.attention.base import DECODE_SLICE_ROWS
from tokenmill.layers.attention.torch_backend import TorchPagedAttention
from tokenmill.step.layout import attention_group_key, layout_decode, layout_rows, layout_step

BLOCK_SIZE = 16
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def decode_step(seq_lens: list[int]) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """Block ids (consecutive), query lens (all 1) and sequence lengths, in group-key order."""
    seq_lens = sorted(seq_lens, key=lambda n: attention_group_key(1, n))
    block_ids, next_block = [], 0
    for n in seq_lens:
        count = -(-n // BLOCK_SIZE)
        block_ids.append(list(range(next_block, next_block + count)))
        next_block += count
    return block_ids, np.ones(len(seq_lens), dtype=np.int64), np.array(seq_lens, dtype=np.int64)


def test_one_deep_decode_does_not_pad_the_short_ones_to_its_context() -> None:
    block_ids, query_lens, seq_lens = decode_step([64, 3500, 70, 60])
    _, metadata = layout_step(
        block_ids, query_lens, seq_lens, BLOCK_SIZE, None, torch.device("cpu")
    )
    kv_lens = sorted(group.kv_len for group in metadata.groups)
    assert kv_lens == [70, 3500]  # one group read 3,500 positions for every row before


def attend_and_check(
    block_ids: list[list[int]],
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    sliding_window: int | None = None,
) -> list:
    """The portable backend's decode attention of a step against each row on its own (its
    new key written first); returns the step's attention groups."""
    _, metadata = layout_step(
        block_ids, query_lens, seq_lens, BLOCK_SIZE, sliding_window, torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(len(ids) for ids in block_ids)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    query = torch.randn(len(seq_lens), HEADS, HEAD_DIM, generator=gen)
    kv = torch.randn(len(seq_lens), 2, KV_HEADS, HEAD_DIM, generator=gen)
    attention = TorchPagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    out = attention.forward(query, kv, cache, metadata)  # writes each row's new key first
    for row, (ids, n) in enumerate(zip(block_ids, seq_lens)):
        first = 0 if sliding_window is None else max(0, n - sliding_window)
        keys, values = cache[:, ids].reshape(2, -1, KV_HEADS, HEAD_DIM)[:, first:n].transpose(1, 2)
        expected = F.scaled_dot_product_attention(
            query[row][:, None], keys, values, scale=HEAD_DIM**-0.5, enable_gqa=True
        )[:, 0]
        torch.testing.assert_close(out[row], expected)
    return metadata.groups


def test_split_groups_attend_each_row_to_its_own_context() -> None:
    groups = attend_and_check(*decode_step([64, 3500, 70, 300, 600, 5]))
    assert len(groups) > 1


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_a_large_decode_group_is_attended_in_slices_each_to_its_own_contexts(
    sliding_window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch_backend, "DECODE_SLICE_ABOVE_BYTES", 0)  # these heads are tiny
    lengths = [300 + (37 * i) % 200 for i in range(2 * DECODE_SLICE_ROWS + 3)]
    groups = attend_and_check(*decode_step(lengths), sliding_window=sliding_window)
    (group,) = groups
    assert group.row_slices is not None and len(group.row_slices) == 3
    # Each slice pads only to its own longest row.
    assert [kv_len for _, _, kv_len in group.row_slices] == [
        max(lengths[i : i + DECODE_SLICE_ROWS]) for i in range(0, len(lengths), DECODE_SLICE_ROWS)
    ]


def test_equal_decode_contexts_are_sliced_without_a_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_backend, "DECODE_SLICE_ABOVE_BYTES", 0)
    groups = attend_and_check(*decode_step([200] * (DECODE_SLICE_ROWS + 5)))
    assert groups[0].mask is None and groups[0].row_slices is not None


@pytest.mark.parametrize(
    ("query_lens", "uniform"), [([5, 5, 5], True), ([5, 3, 5], False), ([4], True)]
)
def test_multi_token_rows_attend_causally_to_their_own_context(
    query_lens: list[int], uniform: bool
) -> None:
    """Draft verifications and short chunks (one group): rows of equal query length are
    attended as they lie, without the padded copy; either way, query j of a row sees its
    context and its own queries up to j."""
    seq_lens = np.array([37 + 11 * i for i in range(len(query_lens))], dtype=np.int64)
    lens = np.array(query_lens, dtype=np.int64)
    block_ids, next_block = [], 0
    for n in seq_lens:
        count = -(-int(n) // BLOCK_SIZE)
        block_ids.append(list(range(next_block, next_block + count)))
        next_block += count
    _, metadata = layout_step(block_ids, lens, seq_lens, BLOCK_SIZE, None, torch.device("cpu"))
    (group,) = metadata.groups
    assert (group.padded_index is None) == uniform
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, next_block, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    tokens = int(lens.sum())
    query = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen)
    kv = torch.randn(tokens, 2, KV_HEADS, HEAD_DIM, generator=gen)
    out = TorchPagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5).forward(
        query, kv, cache, metadata
    )
    start = 0
    for ids, n, q in zip(block_ids, seq_lens.tolist(), query_lens):
        keys, values = cache[:, ids].reshape(2, -1, KV_HEADS, HEAD_DIM)[:, :n].transpose(1, 2)
        for j in range(q):
            seen = n - q + j + 1
            expected = F.scaled_dot_product_attention(
                query[start + j][:, None],
                keys[:, :seen],
                values[:, :seen],
                scale=HEAD_DIM**-0.5,
                enable_gqa=True,
            )[:, 0]
            torch.testing.assert_close(out[start + j], expected)
        start += q


@pytest.mark.parametrize("rows", ["decode", "verify"])
@pytest.mark.parametrize("sliding_window", [None, 40])
def test_lean_layouts_are_the_general_layout(sliding_window: int | None, rows: str) -> None:
    """`layout_decode` (Python ints, for steps of one token per sequence) and `layout_rows`
    (a few rows a sequence: draft verifications) lay out exactly what `layout_step` does:
    positions, slots, the CPU step, the groups."""
    rng = np.random.default_rng(0)
    for num_seqs in (1, 2, 7, 33):
        block_ids, query_lens, seq_lens = decode_step(rng.integers(10, 700, num_seqs).tolist())
        block_ids = [[*ids, 999] for ids in block_ids]  # a block allocated past the tokens
        if rows == "verify":
            query_lens = rng.integers(1, 10, num_seqs)
        cpu = torch.device("cpu")
        positions, general = layout_step(
            block_ids, query_lens, seq_lens, BLOCK_SIZE, sliding_window, cpu
        )
        lean_positions, lean = (
            layout_decode(block_ids, seq_lens.tolist(), BLOCK_SIZE, sliding_window, cpu)
            if rows == "decode"
            else layout_rows(
                block_ids, query_lens.tolist(), seq_lens.tolist(), BLOCK_SIZE, sliding_window, cpu
            )
        )
        assert lean_positions.tolist() == positions.tolist()
        assert torch.equal(lean.slot_mapping, general.slot_mapping)
        assert lean.step is not None and general.step is not None
        for name in ("query_start_loc", "seq_lens", "block_tables"):
            lean_value, value = getattr(lean.step, name), getattr(general.step, name)
            assert lean_value.dtype == value.dtype and torch.equal(lean_value, value), name
        assert lean.step.sliding_window == sliding_window
        assert len(lean.groups) == len(general.groups)
        for lean_group, group in zip(lean.groups, general.groups):
            for name, value in vars(group).items():
                lean_value = getattr(lean_group, name)
                if isinstance(value, torch.Tensor):
                    assert torch.equal(lean_value, value), name
                else:
                    assert lean_value == value, name
