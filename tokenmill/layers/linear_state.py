"""The state cache of a hybrid model's linear-attention layers (gated DeltaNet): one slot per
running sequence, beside the paged KV cache of its full-attention layers.

A slot holds, for every linear layer, the conv state (the last `kernel - 1` inputs of the
causal depthwise conv1d) and the recurrent state (`[v_heads, k_dim, v_dim]` float32). Its size
does not grow with the context: what a full-attention layer's KV costs per token, a linear
layer costs once per sequence. The runner (worker/model_runner.py) takes a zeroed slot when a
sequence is admitted, gives it back when it finishes or is preempted (preemption recomputes:
the re-admitted sequence starts from a zeroed slot), and tells the cache each step which rows
are whose (`prepare`); the layers read `step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokenmill.layers.state_snapshots import StateSnapshots


@dataclass(frozen=True)
class LinearStateSpec:
    """One linear-attention layer's state, per sequence."""

    num_layers: int  # linear-attention layers
    conv_dim: int  # channels of the conv1d (q, k and v together)
    conv_kernel: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    conv_dtype: torch.dtype  # the model's dtype; the recurrent state is float32

    @property
    def bytes_per_slot(self) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * self.conv_dtype.itemsize
        recurrent = self.num_v_heads * self.k_dim * self.v_dim * 4
        return self.num_layers * (conv + recurrent)


@dataclass
class LinearStateStep:
    """Which rows of a step belong to which slot: sequence i is rows
    [row_starts[i], row_starts[i + 1]) (`row_starts` has one more entry than `slots`), its
    first `num_decodes` sequences one row each."""

    slots: list[int]
    row_starts: list[int]
    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes] int64: the slots of the decode rows
    # Sequence index -> (its rows before a block boundary, the snapshot slot to save there).
    cuts: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Sequence index -> (request, first position, known rows, block table) of a sequence
    # verifying drafts: its layers keep the state after each row (`positions`) until `accept`.
    verifying: dict[int, tuple[str, int, int, list[int]]] = field(default_factory=dict)


# torch runs an op over more elements than this on its OpenMP threads (at::internal's grain).
_TORCH_GRAIN = 32768


def serial_zero_(tensor: torch.Tensor) -> None:
    """Zero a contiguous tensor in pieces torch runs on the calling thread: a 1 MiB state
    zeroed by torch's parallel fill took ~16 ms inside the engine on a loaded 2-core machine
    (waking OpenMP threads beside the native kernels' pool), 18 layers a sequence admitted."""
    for piece in tensor.view(-1).split(_TORCH_GRAIN):
        piece.zero_()


class LinearStateCache:
    """The slots' tensors, per linear layer, and which sequence holds which slot."""

    def __init__(self, spec: LinearStateSpec, num_slots: int, device: torch.device) -> None:
        self.spec = spec
        conv_shape = (num_slots, spec.conv_dim, spec.conv_kernel - 1)
        state_shape = (num_slots, spec.num_v_heads, spec.k_dim, spec.v_dim)
        self.conv = [
            torch.zeros(conv_shape, dtype=spec.conv_dtype, device=device)
            for _ in range(spec.num_layers)
        ]
        self.recurrent = [
            torch.zeros(state_shape, dtype=torch.float32, device=device)
            for _ in range(spec.num_layers)
        ]
        self.device = device
        self._free = list(range(num_slots - 1, -1, -1))
        self.slot_of: dict[str, int] = {}
        self.step: LinearStateStep | None = None
        self.snapshots: StateSnapshots | None = None  # with prefix caching (`use_snapshots`)
        self.block_size = 0
        # Per layer, per verifying sequence index: (conv, recurrent) states after each row.
        self.positions: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in range(spec.num_layers)
        ]

    def use_snapshots(self, num_slots: int, block_size: int) -> StateSnapshots:
        """Keep `num_slots` snapshots at block boundaries, for prefix hits."""
        self.snapshots = StateSnapshots(self.conv, self.recurrent, num_slots)
        self.block_size = block_size
        return self.snapshots

    @property
    def num_free(self) -> int:
        return len(self._free)

    def admit(self, req_id: str, num_computed: int = 0, block_ids: Sequence[int] = ()) -> int:
        """A slot for a sequence: zeroed, or, after a prefix hit of `num_computed` tokens (a
        block boundary), the snapshot kept with the hit's last block."""
        if not self._free:
            raise RuntimeError("no free linear-attention state slot (more than max_num_seqs)")
        slot = self._free.pop()
        source = None
        if num_computed:
            assert self.snapshots is not None and num_computed % self.block_size == 0
            source = self.snapshots.slot_to_read(block_ids[num_computed // self.block_size - 1])
        for layer, (conv, recurrent) in enumerate(zip(self.conv, self.recurrent, strict=True)):
            if source is None:
                serial_zero_(conv[slot])
                serial_zero_(recurrent[slot])
            else:
                assert self.snapshots is not None
                conv[slot].copy_(self.snapshots.conv[layer][source])
                recurrent[slot].copy_(self.snapshots.recurrent[layer][source])
        self.slot_of[req_id] = slot
        return slot

    def release(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def prepare(
        self,
        req_ids: Sequence[str],
        row_starts: Sequence[int],
        num_rows: int,
        first_positions: Sequence[int] = (),
        known_ends: Sequence[int] = (),
        block_tables: Sequence[list[int]] = (),
    ) -> None:
        """The step's rows, request by request in row order (decodes first); with positions,
        which sequences cross a block boundary (a snapshot is saved there) and which verify
        drafts (rows past `known_ends`)."""
        starts = [*row_starts, num_rows]
        slots = [self.slot_of[r] for r in req_ids]
        num_decodes = 0
        while num_decodes < len(slots) and starts[num_decodes + 1] - starts[num_decodes] == 1:
            num_decodes += 1
        decode_slots = torch.tensor(slots[:num_decodes], dtype=torch.int64, device=self.device)
        step = LinearStateStep(slots, starts, num_decodes, decode_slots)
        for i, (first, known_end) in enumerate(zip(first_positions, known_ends, strict=True)):
            if starts[i + 1] - starts[i] > known_end - first:
                step.verifying[i] = (req_ids[i], first, known_end - first, block_tables[i])
                continue
            slot = self._snapshot_slot(first, known_end, block_tables[i])
            if slot is not None:
                step.cuts[i] = (known_end // self.block_size * self.block_size - first, slot)
        for positions in self.positions:
            positions.clear()
        self.step = step

    def _snapshot_slot(self, first: int, end: int, block_table: list[int]) -> int | None:
        """The snapshot slot for the last block boundary in (first, end], if any."""
        if self.snapshots is None or end // self.block_size <= first // self.block_size:
            return None
        return self.snapshots.slot_to_write(block_table[end // self.block_size - 1])

    def accept(self, num_accepted: dict[str, int]) -> None:
        """Roll each verifying sequence's states back to its last accepted row (`num_accepted`:
        drafts accepted per request), saving a snapshot at a boundary among its rows."""
        assert self.step is not None
        for i, (req_id, first, known, table) in self.step.verifying.items():
            row = known + num_accepted.get(req_id, 0) - 1
            slot, end = self.step.slots[i], first + row + 1
            snapshot = self._snapshot_slot(first, end, table)
            boundary_row = end // self.block_size * self.block_size - first - 1
            for layer, positions in enumerate(self.positions):
                conv, recurrent = positions[i]
                self.conv[layer][slot].copy_(conv[row])
                self.recurrent[layer][slot].copy_(recurrent[row])
                if snapshot is not None:
                    assert self.snapshots is not None
                    self.snapshots.save(
                        layer, snapshot, conv[boundary_row], recurrent[boundary_row]
                    )
        for positions in self.positions:
            positions.clear()
