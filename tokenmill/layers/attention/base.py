"""What every paged-attention backend shares: a step's attention metadata and the base class
`PagedAttention` (the backends: torch_backend.py, cpu_backend.py, triton_backend.py).

A step's tokens arrive flat (`[num_tokens, heads, head_dim]`), requests one after another,
ordered so that single-token requests (decodes) come first. New keys and values are written
into the paged cache through `slot_mapping`; attention then reads each request's whole context
back through its block table, so a prefill chunk, a decode and a resumed request are the same
computation with different lengths. Keys and values travel together (`[num_tokens, 2,
kv_heads, head_dim]`, as the fused QKV projection lays them out), one copy in and one out.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.layers.kv_cache import write_kv

# KV cache of one layer: [2 (key, value), num_blocks, block_size, num_kv_heads, head_dim]
KVCache = torch.Tensor
# Decode rows the portable backend attends at once (`decode_slices`) when a decode group's
# gathered keys and values would exceed its DECODE_SLICE_ABOVE_BYTES (torch_backend.py): 8
# rows ran fastest of 1-32 at contexts of 256-1,000 (SmolLM2-135M's heads, fp32).
DECODE_SLICE_ROWS = 8


@dataclass
class AttentionGroup:
    """Requests attended together as one padded batch of `[num_seqs, max_query_len]` queries.

    Decodes (query length 1) and longer chunks are separate groups so that one long prefill
    chunk does not pad every decode to its length.
    """

    token_start: int  # the group's tokens are [token_start, token_end) of the step's tokens
    token_end: int
    max_query_len: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    kv_len: int  # keys attended: the longest sequence's length
    # [num_seqs, 1, max_query_len, kv_len] bool; None where every query sees every key (decodes
    # of equally long sequences without a sliding window, e.g. any single decode).
    mask: torch.Tensor | None
    # For groups with max_query_len > 1 whose query lengths differ: where each flat token sits
    # in the padded batch, as a row of the flattened [num_seqs * max_query_len] queries. None
    # where every sequence has max_query_len queries (the flat tokens are the batch already).
    padded_index: torch.Tensor | None = None  # [group tokens]
    # For kernels that read the cache through the block tables (no padding, no mask):
    # sequence i's queries are the group's tokens [query_start_loc[i], query_start_loc[i + 1])
    # and the last ones of its seq_lens[i] tokens.
    query_start_loc: torch.Tensor | None = None  # [num_seqs + 1] int32
    seq_lens: torch.Tensor | None = None  # [num_seqs] int32
    sliding_window: int | None = None  # a query sees only the keys of its last n positions
    # For decode groups on the portable backend: (first row, end row, keys attended) of each
    # slice of rows attended together (`decode_slices`); None: the group at once.
    row_slices: list[tuple[int, int, int]] | None = None
    # Masks of the layers with a window of their own (`windowed_mask`), by window.
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def windowed_mask(self, window: int) -> torch.Tensor:
        """The group's mask for a layer attending within `window` positions (built once per
        step, shared by every layer with that window)."""
        if window not in self.window_masks:
            assert self.query_start_loc is not None and self.seq_lens is not None
            query_lens = (self.query_start_loc[1:] - self.query_start_loc[:-1]).long()
            mask = _attention_mask(query_lens, self.seq_lens.long(), self.kv_len, window)
            assert mask is not None
            self.window_masks[window] = mask
        return self.window_masks[window]


@dataclass
class StepAttention:
    """The whole step at once, for kernels that read the cache through the block tables (the
    CPU backend, the fused decoder stack): sequence i's queries are the step's tokens
    [query_start_loc[i], query_start_loc[i + 1]), the last ones of its seq_lens[i] tokens."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    sliding_window: int | None


class AttentionMetadata:
    """A step's attention inputs, shared by every layer: the cache slots of its tokens, its
    `groups` (for the padded backends) and, on the CPU, the whole `step` at once. Groups may be
    given as a function that builds them when a backend first asks: the CPU backend and the
    fused stack never do, so their steps skip building masks and padded indices."""

    def __init__(
        self,
        slot_mapping: torch.Tensor,  # [num_tokens] int64: cache slot (block * block_size + offset)
        groups: list[AttentionGroup] | Callable[[], list[AttentionGroup]],
        step: StepAttention | None = None,
    ) -> None:
        self.slot_mapping = slot_mapping
        self._groups = groups
        self.step = step
        # A hybrid model's other KV groups' metadata (layers/kv_groups.py): group g >= 1 is
        # kv_groups[g - 1]; the same tokens, their own slots and block tables.
        self.kv_groups: list[AttentionMetadata] = []

    def of_group(self, group: int) -> AttentionMetadata:
        return self if group == 0 else self.kv_groups[group - 1]

    @property
    def groups(self) -> list[AttentionGroup]:
        if callable(self._groups):
            self._groups = self._groups()
        return self._groups


def build_attention_group(
    token_start: int,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> AttentionGroup:
    """Metadata for one group, built once per step and shared by every layer.

    `query_lens[i]` new tokens of sequence i sit at the end of its `seq_lens[i]` tokens; query
    j of sequence i (position `seq_lens[i] - query_lens[i] + j`) sees keys at positions up to
    its own, and within the sliding window if the model has one.
    """
    num_seqs = query_lens.shape[0]
    max_query_len = int(query_lens.max())
    kv_len = int(seq_lens.max())
    group = AttentionGroup(
        token_start=token_start,
        token_end=token_start + int(query_lens.sum()),
        max_query_len=max_query_len,
        block_tables=block_tables,
        kv_len=kv_len,
        mask=_attention_mask(query_lens, seq_lens, kv_len, sliding_window),
        query_start_loc=F.pad(torch.cumsum(query_lens, 0), (1, 0)).to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        sliding_window=sliding_window,
    )
    if max_query_len == 1 and num_seqs > DECODE_SLICE_ROWS:
        group.row_slices = decode_slices(seq_lens.tolist())
    if max_query_len > 1 and group.token_end - token_start < num_seqs * max_query_len:
        seq_index = torch.repeat_interleave(torch.arange(num_seqs), query_lens)
        starts = torch.cumsum(query_lens, 0) - query_lens
        query_index = torch.arange(group.token_end - token_start) - starts[seq_index]
        group.padded_index = seq_index * max_query_len + query_index
    return group


def decode_slices(seq_lens: list[int]) -> list[tuple[int, int, int]]:
    """Slices of `DECODE_SLICE_ROWS` decode rows, each with its longest sequence's length.

    The portable backend gathers a slice's keys and values and attention reads them back at
    once, while they are still in the CPU's cache; a whole group's (32 rows 448 deep: 44 MB a
    layer) went out to memory between the two: decode steps of 32 rows ran 1.2x slower at
    contexts of 256-448 and 2.3x at 1,000 (where allocating it faulted pages in every layer).
    Each slice also pads only to its own longest sequence."""
    return [
        (start, min(start + DECODE_SLICE_ROWS, len(seq_lens)),
         max(seq_lens[start : start + DECODE_SLICE_ROWS]))
        for start in range(0, len(seq_lens), DECODE_SLICE_ROWS)
    ]  # fmt: skip


def _attention_mask(
    query_lens: torch.Tensor, seq_lens: torch.Tensor, kv_len: int, sliding_window: int | None
) -> torch.Tensor | None:
    max_query_len = int(query_lens.max())
    if max_query_len == 1 and sliding_window is None and bool((seq_lens == kv_len).all()):
        return None
    context_lens = seq_lens - query_lens
    query_positions = context_lens[:, None] + torch.arange(max_query_len)[None, :]
    key_positions = torch.arange(kv_len)
    mask = key_positions[None, None, :] <= query_positions[:, :, None]
    if sliding_window is not None:
        mask &= key_positions[None, None, :] > query_positions[:, :, None] - sliding_window
    return mask.unsqueeze(1)


class PagedAttention(ABC):
    """What every backend shares: its shape, writing the step's new keys and values into the
    cache, and one `_attend_group` per attention group, each filling its rows of the output."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # This layer's own window where a model's layers differ (Gemma 3's local layers); None:
        # the step's (the model's, if any).
        self.sliding_window: int | None = None
        # Each head's attention-sink logit `[heads]` (gpt-oss), joining the softmax's
        # denominator; None: no sinks.
        self.sinks: torch.Tensor | None = None
        # The scaled scores soft-capped, cap * tanh(score / cap), before the softmax (Gemma 2's
        # attn_logit_softcapping); None: not capped.
        self.softcap: float | None = None

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv: torch.Tensor,  # [num_tokens, 2 (key, value), num_kv_heads, head_dim]
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(kv_cache, metadata.slot_mapping, kv)
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        for group in metadata.groups:
            start, end = group.token_start, group.token_end
            self._attend_group(query[start:end], kv_cache, group, output[start:end])
        return output

    @abstractmethod
    def _attend_group(
        self, query: torch.Tensor, kv_cache: KVCache, group: AttentionGroup, out: torch.Tensor
    ) -> None:
        """Write the attention of the group's queries (`[tokens, heads, head_dim]`) to `out`."""
