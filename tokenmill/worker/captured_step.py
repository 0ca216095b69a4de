"""Decode-only steps run through a captured step at padded batch sizes (buckets).

A step whose every request decodes one token is padded to the next capture size (1, 2, 4, 8,
16, 24, ... up to `max_num_seqs`) and its context to a power-of-two number of KV blocks; its
inputs are copied into static buffers owned by that (batch, blocks) key, and the step the key
captured runs on them: a CUDA graph replay on a GPU, a `torch.compile`d forward on the CPU
(`worker/capture_backends.py`). Padded rows decode token 0 at position 0 into a scratch KV
block that no request owns; their outputs are dropped. Mixed and prefill steps stay eager.

The attention metadata of a captured step is built here, not by `build_attention_group`: one
decode group whose sizes depend only on the key, with a mask computed from the context lengths
(so no shape depends on the data), and block tables padded with the scratch block. A hybrid
model's other KV groups (layers/kv_groups.py) get the same, through their own block tables, and
every group the masks of the layers' own windows (Gemma's local layers).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.layers.attention.base import AttentionGroup, AttentionMetadata
from tokenmill.worker.capture_backends import (
    compile_forward,
    cuda_graph_capture_factory,
    first_call_capture,
)

logger = logging.getLogger(__name__)

# The model's forward over static inputs: (token ids, positions, metadata) -> hidden states.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
# Turns a forward over fixed buffers into what each step calls (replay) to run it again.
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def capture_sizes(max_num_seqs: int, largest: int | None = None) -> list[int]:
    """Padded batch sizes, as vLLM's CUDA graphs: 1, 2, 4, then multiples of 8, ending at
    `max_num_seqs` (or `largest`, if smaller)."""
    top = max_num_seqs if largest is None else min(largest, max_num_seqs)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return [*sizes, top]


def padded_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest size holding `n`, or None if `n` exceeds them all."""
    for size in sizes:
        if size >= n:
            return size
    return None


def padded_blocks(n: int, max_blocks: int) -> int:
    """A context of `n` blocks padded to a power of two (at most `max_blocks`), so a handful
    of block-table widths cover every context length."""
    return min(1 << max(n - 1, 0).bit_length(), max_blocks)


@dataclass(frozen=True)
class DecodeKey:
    batch: int  # padded number of rows
    blocks: int  # padded number of context blocks per row


@dataclass
class DecodeBatch:
    """A decode-only step: row i decodes `token_ids[i]` at position `seq_lens[i] - 1` of the
    sequence whose KV blocks are `block_ids[i]`."""

    key: DecodeKey
    token_ids: np.ndarray
    block_ids: list[list[int]]
    seq_lens: np.ndarray
    # A hybrid cache's other KV groups: per group, each row's block ids (empty: one group).
    group_block_ids: list[list[list[int]]] = field(default_factory=list)


class _StaticGroup:
    """One KV group's buffers: its rows' slots, block tables and masks (the step's window and
    each layer window's)."""

    def __init__(
        self, key: DecodeKey, block_size: int, windows: Sequence[int], device: torch.device
    ) -> None:
        batch, kv_len = key.batch, key.blocks * block_size
        self.slot_mapping = torch.zeros(batch, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(batch, key.blocks, dtype=torch.int64, device=device)
        self.mask = torch.zeros(batch, 1, 1, kv_len, dtype=torch.bool, device=device)
        self.window_masks = {
            w: torch.zeros(batch, 1, 1, kv_len, dtype=torch.bool, device=device) for w in windows
        }


class StaticDecodeInputs:
    """One key's input buffers, which every step of that key copies into (a captured CUDA
    graph reads them at fixed addresses), and the attention metadata viewing them."""

    def __init__(
        self,
        key: DecodeKey,
        block_size: int,
        scratch_block: int,
        sliding_window: int | None,
        device: torch.device,
        num_groups: int = 1,
        layer_windows: Sequence[int] = (),
    ) -> None:
        """`num_groups`: the KV groups (a hybrid cache's); `layer_windows`: the windows of
        layers attending within their own (their masks kept beside the step's)."""
        self.key = key
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sliding_window = sliding_window
        self.input_ids = torch.zeros(key.batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(key.batch, dtype=torch.int64, device=device)
        # What a kernel reading the block tables needs (layers/attention/selector.py): one
        # query per row, and each row's length.
        self.seq_lens = torch.ones(key.batch, dtype=torch.int32, device=device)
        query_start_loc = torch.arange(key.batch + 1, dtype=torch.int32, device=device)
        self.groups = [
            _StaticGroup(key, block_size, layer_windows, device) for _ in range(num_groups)
        ]
        metadata = [
            AttentionMetadata(
                slot_mapping=group.slot_mapping,
                groups=[
                    AttentionGroup(
                        token_start=0,
                        token_end=key.batch,
                        max_query_len=1,
                        block_tables=group.block_tables,
                        kv_len=key.blocks * block_size,
                        mask=group.mask,
                        query_start_loc=query_start_loc,
                        seq_lens=self.seq_lens,
                        sliding_window=sliding_window,
                        window_masks=group.window_masks,
                    )
                ],
            )
            for group in self.groups
        ]
        self.metadata = metadata[0]
        self.metadata.kv_groups = metadata[1:]
        self.fill(np.zeros(0, dtype=np.int64), [], np.zeros(0, dtype=np.int64))

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.groups[0].slot_mapping  # the primary group's (as every group's below)

    @property
    def block_tables(self) -> torch.Tensor:
        return self.groups[0].block_tables

    @property
    def mask(self) -> torch.Tensor:
        return self.groups[0].mask

    def fill(
        self,
        token_ids: np.ndarray,
        block_ids: Sequence[Sequence[int]],
        seq_lens: np.ndarray,
        group_block_ids: Sequence[Sequence[Sequence[int]]] = (),
    ) -> None:
        """Copy in a decode batch (as `DecodeBatch`'s fields); rows past it are padding."""
        num_rows, (batch, blocks) = len(seq_lens), (self.key.batch, self.key.blocks)
        lens = np.ones(batch, dtype=np.int64)
        lens[:num_rows] = seq_lens
        positions = lens - 1
        keys = np.arange(blocks * self.block_size)
        causal = keys[None, :] <= positions[:, None]

        def within(window: int | None) -> np.ndarray:
            return (
                causal if window is None else causal & (keys[None, :] > positions[:, None] - window)
            )

        ids = np.zeros(batch, dtype=np.int64)
        ids[:num_rows] = token_ids
        copies = [(self.input_ids, ids), (self.positions, positions)]
        copies.append((self.seq_lens, lens.astype(np.int32)))
        for group, group_ids in zip(self.groups, [block_ids, *group_block_ids]):
            table = np.full((batch, blocks), self.scratch_block, dtype=np.int64)
            for row, (row_ids, n) in enumerate(zip(group_ids, -(-seq_lens // self.block_size))):
                table[row, :n] = row_ids[:n]
            slots = table[np.arange(batch), positions // self.block_size] * self.block_size
            copies += [(group.slot_mapping, slots + positions % self.block_size)]
            copies += [(group.block_tables, table)]
            copies += [(group.mask, within(self.sliding_window).reshape(group.mask.shape))]
            copies += [(m, within(w).reshape(m.shape)) for w, m in group.window_masks.items()]
        for buffer, values in copies:
            buffer.copy_(torch.from_numpy(values), non_blocking=True)


class CapturedDecodeStep:
    """Runs decode-only batches through one captured step per (batch, blocks) key, each
    captured on first use (and logged with its time)."""

    def __init__(
        self,
        forward: DecodeForward,
        capture: Capture,
        sizes: Sequence[int],
        max_blocks: int,
        block_size: int,
        scratch_block: int,
        sliding_window: int | None,
        device: torch.device,
        label: str = "captured",
        num_groups: int = 1,
        layer_windows: Sequence[int] = (),
    ) -> None:
        self.forward = forward
        self.num_groups = num_groups
        self.layer_windows = tuple(layer_windows)
        self.capture = capture
        self.sizes = list(sizes)
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sliding_window = sliding_window
        self.device = device
        self.label = label
        self.steps: dict[DecodeKey, tuple[StaticDecodeInputs, Callable[[], torch.Tensor]]] = {}
        self.capture_seconds = 0.0
        self.num_runs = 0  # steps run captured

    def key_for(self, seq_lens: np.ndarray) -> DecodeKey | None:
        """The key a batch of these context lengths runs under; None if it is too large."""
        batch = padded_size(len(seq_lens), self.sizes)
        if batch is None:
            return None
        blocks = -(-int(seq_lens.max()) // self.block_size)
        return DecodeKey(batch, padded_blocks(blocks, self.max_blocks))

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Hidden states of the batch's real rows, `[len(batch.seq_lens), hidden]`."""
        entry = self.steps.get(batch.key)
        if entry is None:
            entry = self._capture(batch.key)
        inputs, replay = entry
        inputs.fill(batch.token_ids, batch.block_ids, batch.seq_lens, batch.group_block_ids)
        self.num_runs += 1
        return replay()[: len(batch.seq_lens)]

    def _capture(self, key: DecodeKey) -> tuple[StaticDecodeInputs, Callable[[], torch.Tensor]]:
        inputs = StaticDecodeInputs(
            key,
            self.block_size,
            self.scratch_block,
            self.sliding_window,
            self.device,
            self.num_groups,
            self.layer_windows,
        )
        logger.info(
            "%s decode step for batch size %d, %d context blocks (%d of %d batch sizes)...",
            self.label,
            key.batch,
            key.blocks,
            len({k.batch for k in self.steps} | {key.batch}),
            len(self.sizes),
        )
        start = time.perf_counter()
        replay = self.capture(
            lambda: self.forward(inputs.input_ids, inputs.positions, inputs.metadata)
        )
        seconds = time.perf_counter() - start
        self.capture_seconds += seconds
        logger.info("%s decode step for batch size %d in %.1f s", self.label, key.batch, seconds)
        self.steps[key] = (inputs, replay)
        return inputs, replay


def build_decode_step(
    forward: DecodeForward,
    device: torch.device,
    max_num_seqs: int,
    max_blocks: int,
    block_size: int,
    scratch_block: int,
    sliding_window: int | None,
    capture: Capture | None = None,
    compile_backend: str = "inductor",
    num_groups: int = 1,
    layer_windows: Sequence[int] = (),
) -> CapturedDecodeStep:
    """CUDA graphs on a GPU; elsewhere the forward compiled by `torch.compile` (with
    `compile_backend`); or the given `capture` of the uncompiled forward (tests).
    `num_groups`, `layer_windows`: a hybrid cache's KV groups, the layers' own windows."""
    sizes = capture_sizes(max_num_seqs)
    label = "capturing"
    if capture is None and device.type == "cuda":
        capture, label = cuda_graph_capture_factory(device), "capturing CUDA graph of"
    elif capture is None:
        max_keys = len(sizes) * max_blocks.bit_length()
        forward = compile_forward(forward, max_keys, compile_backend)
        capture = first_call_capture
        label = "compiling"
        logger.info(
            "decode steps compile on the first use of each (batch size, context blocks) key: "
            "about a minute of CPU time each for a 30-layer model, on a restart too "
            "(docs/benchmarks.md); --enforce-eager runs them eagerly"
        )
    return CapturedDecodeStep(
        forward,
        capture,
        sizes,
        max_blocks,
        block_size,
        scratch_block,
        sliding_window,
        device,
        label,
        num_groups,
        layer_windows,
    )
