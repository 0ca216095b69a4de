"""`LoRALinear`: a decoder linear (any weight format: float, int8, int4, GGUF) with the
adapters of the step added after its product. It holds every slot's A and B stacked
(`a: [slots, parts * R, in]`, `bt: [slots, parts * R, out]`, B transposed so that the expand
reads outputs in order; R = --max-lora-rank): a fused layer (q/k/v, gate/up) keeps each part's
A in its own rows and its B in its own block of rows and columns, so one shrink and one expand
serve every part.

Under tensor parallelism a rank holds its shard of the adapter as of the base weight (as vLLM
does): a column-parallel layer (q/k/v, gate/up) the rows of B for its outputs, a row-parallel
one (o, down) the columns of A for its inputs. The partial shrinks of a row-parallel layer sum
through the base layer's own all-reduce (the product is linear), so LoRA adds no collective."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.lora.peft_adapter import PeftAdapter
from tokenmill.lora.punica import Segment, add_lora_


@dataclass
class StepLoRAMapping:
    """Which rows of this step's tokens run with which slot: every `LoRALinear` of the model
    reads the one instance, set by the manager before each forward. No segments: base only."""

    segments: list[Segment] = field(default_factory=list)
    segment_tensor: torch.Tensor | None = None


@dataclass(frozen=True)
class LoRAPart:
    """One peft module inside a (maybe fused) layer: its name, its output rows in the layer,
    and the first of the adapter's B rows they take (not 0 on a column-parallel rank > 0)."""

    module: str
    out_start: int
    out_size: int
    source_start: int = 0


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        layer_index: int,
        parts: list[LoRAPart],
        in_features: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        mapping: StepLoRAMapping,
        device: torch.device | None = None,
        in_start: int | None = None,
    ) -> None:
        """`in_start`: a row-parallel rank's first input column (its A columns); None: all."""
        super().__init__()
        self.base = base
        self.layer_index = layer_index
        self.parts = parts
        self.max_rank = max_rank
        self.mapping = mapping
        self.in_start = in_start
        self.in_features = in_features
        out_features = sum(p.out_size for p in parts)
        width = len(parts) * max_rank
        shapes = ((max_loras, width, in_features), (max_loras, width, out_features))
        self.register_buffer("a", torch.zeros(shapes[0], dtype=dtype, device=device))
        self.register_buffer("bt", torch.zeros(shapes[1], dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.mapping.segments:
            add_lora_(y, x, self.a, self.bt, self.mapping.segments, self.mapping.segment_tensor)
        return y

    def set_slot(self, slot: int, adapter: PeftAdapter) -> None:
        """Write `adapter`'s weights for this layer into `slot` (zeros where it has none)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        for index, part in enumerate(self.parts):
            pair = adapter.pairs.get((self.layer_index, part.module))
            if pair is None:
                continue
            a, b = pair
            if self.in_start is not None:
                a = a[:, self.in_start : self.in_start + self.in_features]
            b = b[part.source_start : part.source_start + part.out_size]
            rank, column = a.shape[0], index * self.max_rank
            self.a[slot, column : column + rank] = a
            outputs = slice(part.out_start, part.out_start + part.out_size)
            self.bt[slot, column : column + rank, outputs] = b.T
