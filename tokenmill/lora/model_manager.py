"""The model side of LoRA: `LoRALinear`s put around every decoder linear once, the slots
(--max-loras adapters resident in the stacked weights, least recently used replaced first),
and each step's row -> slot mapping.

Under tensor parallelism every rank installs the same layers over its shard (layer.py says
which part of an adapter each holds) and maps the same rows: the step is broadcast whole.

The fused native decoder stack (models/llama_stack.py) reads every layer's stacked slots in
place and this step's rows, and adds the adapters beside its own products; without it (tensor
parallelism, a mixture-of-experts MLP, no native build) the `LoRALinear`s add them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from tokenmill.lora.layer import LoRALinear, LoRAPart, StepLoRAMapping
from tokenmill.lora.peft_adapter import BaseShapes, PeftAdapter
from tokenmill.lora.punica import Segment
from tokenmill.models.llama import LlamaMLP
from tokenmill.models.sharding import rank_slice


class LoRAState(Protocol):
    """What the manager reads of a request in the step (the runner's `CachedRequestState`)."""

    lora: PeftAdapter | None


class LoRAModelManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.mapping = StepLoRAMapping()
        self.layers: list[LoRALinear] = []
        self.base_shapes = base_shapes(model)
        self._fused_stack = getattr(model, "decoder_stack", None)
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first
        self._in_slot: list[PeftAdapter | None] = [None] * max_loras
        self._install()
        if self._fused_stack is not None:
            self._fused_stack.use_lora(self.mapping, self._stack_tensors())

    def _install(self) -> None:
        dtype = _model_dtype(self.model)
        device = self.model.layers[0].input_layernorm.weight.device
        for index, decoder_layer in enumerate(self.model.layers):
            attention, mlp = decoder_layer.self_attn, decoder_layer.mlp
            fused = {
                (attention, "self_attn", "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
                (attention, "self_attn", "o_proj"): ("o_proj",),
            }
            if "gate_proj" in self.base_shapes.modules:
                fused[(mlp, "mlp", "gate_up_proj")] = ("gate_proj", "up_proj")
                fused[(mlp, "mlp", "down_proj")] = ("down_proj",)
            for (parent, owner, attribute), modules in fused.items():
                target = f"layers.{index}.{owner}.{attribute}.weight"
                parts, in_features, in_start = self._parts(target, modules)
                wrapper = LoRALinear(
                    getattr(parent, attribute),
                    index,
                    parts,
                    in_features,
                    self.max_loras,
                    self.max_lora_rank,
                    dtype,
                    self.mapping,
                    device,
                    in_start,
                )
                setattr(parent, attribute, wrapper)
                self.layers.append(wrapper)

    def _parts(
        self, target: str, modules: tuple[str, ...]
    ) -> tuple[list[LoRAPart], int, int | None]:
        """A layer's parts, its input width and first input column on this rank (None: all),
        from the slice of the base weight this rank holds (models/sharding.py)."""
        whole = self.base_shapes.modules
        parts, start = [], 0
        in_features, in_start = whole[modules[0]][0], None
        for part_index, module in enumerate(modules):
            piece = rank_slice(self.model, target, part_index if len(modules) > 1 else None)
            size, source = whole[module][1], 0
            if piece is not None and piece.dim == 0:  # column-parallel: B's rows
                size, source = piece.length, piece.start
            elif piece is not None:  # row-parallel: A's columns
                in_features, in_start = piece.length, piece.start
            parts.append(LoRAPart(module, start, size, source))
            start += size
        return parts, in_features, in_start

    def _stack_tensors(self) -> list[list[torch.Tensor | None]]:
        """Each layer's `(a, bt)` for qkv, o, gate_up, down, as the fused stack takes them."""
        per_layer: list[list[torch.Tensor | None]] = [[None] * 8 for _ in self.model.layers]
        order = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
        for decoder_layer, tensors in zip(self.model.layers, per_layer, strict=True):
            owners = (decoder_layer.self_attn,) * 2 + (decoder_layer.mlp,) * 2
            for index, (owner, name) in enumerate(zip(owners, order, strict=True)):
                layer = getattr(owner, name, None)
                if isinstance(layer, LoRALinear):
                    tensors[2 * index], tensors[2 * index + 1] = layer.a, layer.bt
        return per_layer

    @property
    def resident_ids(self) -> list[int]:
        """Adapter ids in the slots, least recently used first."""
        return list(self._slot_of)

    def prepare_step(
        self, states: Sequence[LoRAState], row_starts: Sequence[int], num_rows: int
    ) -> None:
        """Put the step's adapters into slots and map its rows to them."""
        adapters = {s.lora.lora_int_id: s.lora for s in states if s.lora is not None}
        if len(adapters) > self.max_loras:
            raise RuntimeError(f"{len(adapters)} adapters in one step, above max_loras")
        slots = {lora_id: self._activate(a, adapters.keys()) for lora_id, a in adapters.items()}
        segments: list[Segment] = []
        ends = [*row_starts[1:], num_rows]
        for state, first, end in zip(states, row_starts, ends, strict=True):
            if state.lora is None or end <= first:
                continue
            slot = slots[state.lora.lora_int_id]
            if segments and segments[-1][2] == slot and segments[-1][1] == first:
                segments[-1] = (segments[-1][0], end, slot)
            else:
                segments.append((first, end, slot))
        self.mapping.segments = segments
        self.mapping.segment_tensor = (
            torch.tensor(segments, dtype=torch.int64) if segments else None
        )

    def _activate(self, adapter: PeftAdapter, in_step: Any) -> int:
        lora_id = adapter.lora_int_id
        slot = self._slot_of.get(lora_id)
        resident = None if slot is None else self._in_slot[slot]
        if resident is not None and resident.uid == adapter.uid:
            self._slot_of.move_to_end(lora_id)
            return slot
        if slot is None:
            slot = self._free_slot(in_step)
        for layer in self.layers:
            layer.set_slot(slot, adapter)
        self._in_slot[slot] = adapter
        self._slot_of[lora_id] = slot
        self._slot_of.move_to_end(lora_id)
        return slot

    def _free_slot(self, in_step: Any) -> int:
        taken = set(self._slot_of.values())
        free = next((s for s in range(self.max_loras) if s not in taken), None)
        if free is not None:
            return free
        victim = next(lora_id for lora_id in self._slot_of if lora_id not in in_step)
        return self._slot_of.pop(victim)

    def clear_step(self) -> None:
        self.mapping.segments = []
        self.mapping.segment_tensor = None


def base_shapes(model: nn.Module) -> BaseShapes:
    """The whole model's `(in, out)` of each module an adapter may target (under tensor
    parallelism too: adapters are checked whole, each rank takes its shard). A model with a
    mixture-of-experts MLP offers the attention modules only."""
    shape = model.shape
    hidden, q, kv = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
    )
    modules = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv)}
    modules["o_proj"] = (q, hidden)
    heads = {"num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads}
    if not all(isinstance(layer.mlp, LlamaMLP) for layer in model.layers):
        return BaseShapes(len(model.layers), modules, moe=True, **heads)
    inter = model.intermediate_size_of("layers.0.mlp.gate_up_proj.weight")
    modules |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter)}
    modules["down_proj"] = (inter, hidden)
    return BaseShapes(len(model.layers), modules, **heads)


def _model_dtype(model: nn.Module) -> torch.dtype:
    norm = model.layers[0].input_layernorm.weight
    return norm.dtype
