"""The model side of LoRA: `LoRALinear`s put around every decoder linear once, the slots
(--max-loras adapters resident in the stacked weights, least recently used replaced first),
and each step's row -> slot mapping.

The fused native decoder stack (models/llama_stack.py) knows nothing of adapters: a step with
any adapter rows runs the layer modules (the reference path); a base-only step still runs the
fused stack."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import nn

from tokenmill.lora.layer import LoRALinear, LoRAPart, StepLoRAMapping
from tokenmill.lora.peft_adapter import BaseShapes, PeftAdapter
from tokenmill.lora.punica import Segment


class LoRAState(Protocol):
    """What the manager reads of a request in the step (the runner's `CachedRequestState`)."""

    lora: PeftAdapter | None


class LoRAModelManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int) -> None:
        if getattr(getattr(model, "tp", None), "size", 1) > 1:
            raise ValueError("LoRA with tensor parallelism is not supported yet")
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

    def _install(self) -> None:
        shapes, dtype = self.base_shapes.modules, _model_dtype(self.model)
        device = self.model.layers[0].input_layernorm.weight.device
        for index, decoder_layer in enumerate(self.model.layers):
            attention, mlp = decoder_layer.self_attn, decoder_layer.mlp
            fused = {
                (attention, "qkv_proj"): ("q_proj", "k_proj", "v_proj"),
                (attention, "o_proj"): ("o_proj",),
                (mlp, "gate_up_proj"): ("gate_proj", "up_proj"),
                (mlp, "down_proj"): ("down_proj",),
            }
            for (parent, attribute), modules in fused.items():
                parts, start = [], 0
                for module in modules:
                    parts.append(LoRAPart(module, start, shapes[module][1]))
                    start += shapes[module][1]
                in_features = shapes[modules[0]][0]
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
                )
                setattr(parent, attribute, wrapper)
                self.layers.append(wrapper)

    @property
    def resident_ids(self) -> list[int]:
        """Adapter ids in the slots, least recently used first."""
        return list(self._slot_of)

    def prepare_step(
        self, states: Sequence[LoRAState], row_starts: Sequence[int], num_rows: int
    ) -> None:
        """Put the step's adapters into slots and map its rows to them; the fused stack is
        set aside for a step with adapter rows."""
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
        self.model.decoder_stack = None if segments else self._fused_stack

    def _activate(self, adapter: PeftAdapter, in_step: Any) -> int:
        lora_id = adapter.lora_int_id
        slot = self._slot_of.get(lora_id)
        if slot is not None and self._in_slot[slot] is adapter:
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
        self.model.decoder_stack = self._fused_stack


def base_shapes(model: nn.Module) -> BaseShapes:
    """The `(in, out)` of each module an adapter may target, from a Llama-family model."""
    attention, mlp = model.layers[0].self_attn, model.layers[0].mlp
    hidden = model.shape.hidden_size
    q, kv, inter = attention.q_size, attention.kv_size, mlp.intermediate_size
    return BaseShapes(
        num_layers=len(model.layers),
        modules={
            "q_proj": (hidden, q),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "o_proj": (q, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        },
    )


def _model_dtype(model: nn.Module) -> torch.dtype:
    norm = model.layers[0].input_layernorm.weight
    return norm.dtype
