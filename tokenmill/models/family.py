"""What a decoder family module (models/families/) declares: the checkpoints it reads
(config.json `architectures`, GGUF `general.architecture`) and how they map onto the shared
decoder pieces (`ArchitectureTraits`: attention variant, norm placement, MLP activation, RoPE
kind; `split_tensor`: checkpoint tensors stored differently; `mlp`: the layers' MLP/FFN)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.models.traits import ArchitectureTraits

# Reads a checkpoint tensor, or only a slice of it (`loader.TensorReader`).
TensorReader = Callable[[Any], torch.Tensor]
# (checkpoint name, reader) -> the (name, reader) pairs the shared loader expects.
TensorSplitter = Callable[[str, TensorReader, Any], Iterator[tuple[str, TensorReader]]]
# Builds a layer's MLP/FFN: (ModelShape, ArchitectureTraits, TensorParallel, layer index,
# hf_config); None: that layer's MLP is the dense one (Qwen-MoE's `mlp_only_layers`).
MlpBuilder = Callable[[Any, ArchitectureTraits, Any, int, Any], torch.nn.Module | None]


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # config.json `architectures`
    traits: Callable[[str, Any], ArchitectureTraits]  # (architecture, hf_config) -> traits
    gguf_architectures: tuple[str, ...] = ()  # GGUF `general.architecture`
    # Checkpoint tensors the shared loader does not read as they are (fused ones to split).
    split_tensor: TensorSplitter | None = None
    # The MLP of each layer; None: the gated dense MLP (models/llama.py's LlamaMLP).
    mlp: MlpBuilder | None = None
    # Its layers are mixtures of experts: a GGUF file of its gguf_architectures has
    # `<architecture>.expert_count` (llama.cpp writes Mixtral as `llama` with experts).
    mixture_of_experts: bool = False
    # The model class; None: the shared decoder (models/llama.py's LlamaForCausalLM).
    model_class: type | None = None
