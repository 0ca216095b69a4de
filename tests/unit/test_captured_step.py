"""The captured decode step's bookkeeping: capture sizes, padding, static buffers, and what a
replay reads (a fake capture stands in for CUDA graphs, which need a GPU)."""

from __future__ import annotations

import argparse

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.engine_args import add_engine_args
from tokenmill.layers.attention.base import AttentionMetadata
from tokenmill.worker.captured_step import (
    CapturedDecodeStep,
    DecodeBatch,
    DecodeKey,
    StaticDecodeInputs,
    capture_sizes,
    padded_blocks,
    padded_size,
)

CPU = torch.device("cpu")
BLOCK = 4
SCRATCH = 99


def test_capture_sizes_follow_vllm_and_end_at_max_num_seqs() -> None:
    assert capture_sizes(256)[:7] == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(256)[-2:] == [248, 256]
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(256, largest=20) == [1, 2, 4, 8, 16, 20]


def test_padded_size_and_blocks() -> None:
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 17, 64)] == [1, 4, 8, 16, 24, 64]
    assert padded_size(65, sizes) is None
    assert [padded_blocks(n, 32) for n in (1, 2, 3, 5, 9, 17, 32)] == [1, 2, 4, 8, 16, 32, 32]
    assert padded_blocks(13, 12) == 12


def test_fill_pads_rows_to_the_scratch_block_and_masks_padded_keys() -> None:
    inputs = StaticDecodeInputs(DecodeKey(batch=4, blocks=4), BLOCK, SCRATCH, None, CPU)
    # Row 0: 6 tokens in blocks [7, 3]; row 1: 9 tokens in [1, 2, 5]; rows 2-3 padding.
    inputs.fill(np.array([11, 12]), [[7, 3], [1, 2, 5, 8]], np.array([6, 9]))
    assert inputs.input_ids.tolist() == [11, 12, 0, 0]
    assert inputs.positions.tolist() == [5, 8, 0, 0]
    scratch_slot = SCRATCH * BLOCK
    assert inputs.slot_mapping.tolist() == [3 * BLOCK + 1, 5 * BLOCK, scratch_slot, scratch_slot]
    assert inputs.block_tables.tolist() == [
        [7, 3, SCRATCH, SCRATCH],
        [1, 2, 5, SCRATCH],
        [SCRATCH] * 4,
        [SCRATCH] * 4,
    ]
    visible = inputs.mask[:, 0, 0].sum(dim=1).tolist()
    assert visible == [6, 9, 1, 1]  # each row sees its own keys; padding only key 0
    group = inputs.metadata.groups[0]
    assert (group.token_start, group.token_end, group.max_query_len) == (0, 4, 1)
    assert group.kv_len == 4 * BLOCK and group.mask is inputs.mask


def test_fill_applies_the_sliding_window() -> None:
    inputs = StaticDecodeInputs(DecodeKey(batch=1, blocks=4), BLOCK, SCRATCH, 3, CPU)
    inputs.fill(np.array([5]), [[0, 1, 2]], np.array([10]))
    assert inputs.mask[0, 0, 0].nonzero().flatten().tolist() == [7, 8, 9]


class FakeGraphs:
    """A fake CUDA-graph capture: records each capture, and replays by running the forward
    again, checking that it reads the very buffers it was captured on."""

    def __init__(self) -> None:
        self.captured: list[tuple[int, ...]] = []
        self.replays = 0

    def __call__(self, run):
        output = run()
        self.captured.append(tuple(output.shape))

        def replay():
            self.replays += 1
            return run()

        return replay


def test_replays_read_the_keys_static_buffers_and_drop_padded_rows() -> None:
    seen: list[tuple[int, ...]] = []

    def forward(ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata):
        seen.append((ids.data_ptr(), positions.data_ptr(), md.slot_mapping.data_ptr()))
        return torch.stack([ids, positions, md.slot_mapping], dim=1)

    graphs = FakeGraphs()
    step = CapturedDecodeStep(forward, graphs, [1, 2, 4, 8], 8, BLOCK, SCRATCH, None, CPU)
    seq_lens = np.array([3, 5, 2])
    key = step.key_for(seq_lens)
    assert key == DecodeKey(batch=4, blocks=2)
    out = step.run(DecodeBatch(key, np.array([4, 5, 6]), [[0], [1, 2], [3]], seq_lens))
    assert out.tolist() == [[4, 2, 2], [5, 4, 2 * BLOCK], [6, 1, 3 * BLOCK + 1]]
    assert graphs.captured == [(4, 3)] and graphs.replays == 1
    # Same key, new contents: no new capture, same buffers.
    out = step.run(DecodeBatch(key, np.array([9]), [[2]], np.array([4])))
    assert out.tolist() == [[9, 3, 2 * BLOCK + 3]]
    assert len(graphs.captured) == 1 and graphs.replays == 2
    assert len(set(seen)) == 1
    # A longer context is a new key (more blocks), captured once.
    long_lens = np.array([9])
    assert step.key_for(long_lens) == DecodeKey(batch=1, blocks=4)
    step.run(DecodeBatch(step.key_for(long_lens), np.array([1]), [[0, 1, 2]], long_lens))
    assert len(graphs.captured) == 2
    assert step.key_for(np.ones(9, dtype=np.int64)) is None  # larger than every size


def test_enforce_eager_decides_where_decode_steps_are_captured() -> None:
    cuda = torch.device("cuda")
    assert not EngineConfig().captures_decode(cuda) and not EngineConfig().captures_decode(CPU)
    assert EngineConfig(enforce_eager=False).captures_decode(cuda)
    assert not EngineConfig(enforce_eager=True).captures_decode(cuda)
    assert EngineConfig(enforce_eager=False).captures_decode(CPU)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--enforce-eager"]).enforce_eager is True
    assert parser.parse_args(["--no-enforce-eager"]).enforce_eager is False
    assert parser.parse_args([]).enforce_eager is None
