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
from dataclasses import dataclass

import torch


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

    @property
    def num_free(self) -> int:
        return len(self._free)

    def admit(self, req_id: str) -> int:
        """A zeroed slot for a sequence starting from its first token."""
        if not self._free:
            raise RuntimeError("no free linear-attention state slot (more than max_num_seqs)")
        slot = self._free.pop()
        for conv, recurrent in zip(self.conv, self.recurrent, strict=True):
            conv[slot].zero_()
            recurrent[slot].zero_()
        self.slot_of[req_id] = slot
        return slot

    def release(self, req_id: str) -> None:
        slot = self.slot_of.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def prepare(self, req_ids: Sequence[str], row_starts: Sequence[int], num_rows: int) -> None:
        """The step's rows, request by request in row order (decodes first)."""
        starts = [*row_starts, num_rows]
        slots = [self.slot_of[r] for r in req_ids]
        num_decodes = 0
        while num_decodes < len(slots) and starts[num_decodes + 1] - starts[num_decodes] == 1:
            num_decodes += 1
        decode_slots = torch.tensor(slots[:num_decodes], dtype=torch.int64, device=self.device)
        self.step = LinearStateStep(slots, starts, num_decodes, decode_slots)
