"""A peft LoRA adapter as peft saves it (`adapter_config.json` + `adapter_model.safetensors`),
read into float32 A/B pairs per (layer, module), its scaling folded into B, and checked
against the base model's shapes: anything it cannot apply is a `LoRAAdapterError` naming why,
before a request runs with it."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

# The decoder linears an adapter may target, by peft's module name.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Targets that are refused with a reason of their own (vLLM refuses them too without
# extra vocabulary support).
_EMBEDDING_MODULES = ("embed_tokens", "lm_head")
_READS = itertools.count(1)
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served on this base model: unreadable, an unsupported
    target or option, a rank above --max-lora-rank, or shapes of another base."""


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit: the base's decoder layer count and, per supported module,
    its `(in_features, out_features)` (the whole model's, one rank)."""

    num_layers: int
    modules: dict[str, tuple[int, int]]
    moe: bool = False  # an MLP of experts: only the attention modules take adapters
    num_heads: int = 0  # attention heads (q's) and KV heads (k's): GGUF adapters' q/k rows
    num_kv_heads: int = 0


@dataclass
class PeftAdapter:
    """An adapter's weights: `pairs[(layer, module)] = (A [r, in], B [out, r] * scaling)`."""

    name: str
    lora_int_id: int
    rank: int
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # This read of it, unique in the engine process and kept by the copies sent to
    # tensor-parallel ranks: a slot holding the same uid needs no rewriting.
    uid: int = field(default_factory=lambda: next(_READS))

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.pairs.values())


def read_peft_adapter(
    path: str | Path, name: str, lora_int_id: int, base: BaseShapes, max_lora_rank: int
) -> PeftAdapter:
    """Read and check the adapter saved at `path`; raises `LoRAAdapterError`."""
    directory = Path(path)
    config = _read_config(directory)
    rank, alpha = _check_config(config, max_lora_rank)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    halves: Halves = {}
    for key, tensor in _read_tensors(directory).items():
        match = _KEY.search(key)
        if match is None and base.moe and ".mlp." in key:
            check_module(name, "gate_proj", base)
        if match is None:
            raise LoRAAdapterError(f"adapter {name!r}: tensor {key!r} is no supported LoRA target")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        add_half(halves, name, base, layer, module, half, tensor)
    return build_adapter(name, lora_int_id, halves, base, max_lora_rank, lambda r: scaling, rank)


# (layer, module) -> {"A": A, "B": B}, as read from a file.
Halves = dict[tuple[int, str], dict[str, torch.Tensor]]


def add_half(
    halves: Halves,
    name: str,
    base: BaseShapes,
    layer: int,
    module: str,
    half: str,
    tensor: torch.Tensor,
) -> None:
    """Keep `tensor`, the A or B (`half`) of `module` in `layer`, after checking its target."""
    check_module(name, module, base)
    if layer >= base.num_layers:
        raise LoRAAdapterError(
            f"adapter {name!r} targets layer {layer}; the base model has "
            f"{base.num_layers} layers (an adapter of another base model?)"
        )
    halves.setdefault((layer, module), {})[half] = tensor.float()


def build_adapter(
    name: str,
    lora_int_id: int,
    halves: Halves,
    base: BaseShapes,
    max_lora_rank: int,
    scaling: Callable[[int], float],
    rank: int | None = None,
) -> PeftAdapter:
    """The adapter of `halves`, each pair's shapes checked against the base model and its B
    scaled by `scaling(its rank)`; `rank`: the rank every pair has (None: each its own)."""
    pairs = {}
    for (layer, module), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"adapter {name!r}: layer {layer} {module} lacks lora_A or B")
        a, b = ab["A"], ab["B"]
        pair_rank = a.shape[0] if rank is None else rank
        if not 1 <= pair_rank <= max_lora_rank:
            raise LoRAAdapterError(
                f"LoRA rank {pair_rank} is above --max-lora-rank {max_lora_rank}"
            )
        in_features, out_features = base.modules[module]
        if a.shape != (pair_rank, in_features) or b.shape != (out_features, pair_rank):
            raise LoRAAdapterError(
                f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                f"{tuple(b.shape)}, the base model needs ({pair_rank}, {in_features}) and "
                f"({out_features}, {pair_rank}) (an adapter of another base model?)"
            )
        pairs[(layer, module)] = (a.contiguous(), (b * scaling(pair_rank)).contiguous())
    if not pairs:
        raise LoRAAdapterError(f"adapter {name!r} holds no LoRA weights")
    return PeftAdapter(name, lora_int_id, max(a.shape[0] for a, _ in pairs.values()), pairs)


def _read_config(directory: Path) -> dict:
    path = directory / "adapter_config.json"
    if not path.is_file():
        raise LoRAAdapterError(f"no adapter_config.json in {directory}")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"{path} is unreadable: {e}") from None


def _check_config(config: dict, max_lora_rank: int) -> tuple[int, float]:
    """The adapter's rank and lora_alpha, after refusing what is not supported."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"peft_type {config.get('peft_type')!r}: only LORA is supported")
    if config.get("use_dora"):
        raise LoRAAdapterError("DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"bias={config['bias']!r}: only bias='none' is supported")
    if config.get("modules_to_save"):
        raise LoRAAdapterError(
            f"modules_to_save {config['modules_to_save']} is not supported (full copies of "
            "base modules)"
        )
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise LoRAAdapterError("per-module rank_pattern/alpha_pattern is not supported")
    targets = config.get("target_modules") or []
    for module in [targets] if isinstance(targets, str) else targets:
        if module in _EMBEDDING_MODULES:
            check_module("", module, None)
    rank = int(config.get("r", 8))
    if not 1 <= rank <= max_lora_rank:
        raise LoRAAdapterError(f"LoRA rank {rank} is above --max-lora-rank {max_lora_rank}")
    return rank, float(config.get("lora_alpha", 8))


def check_module(name: str, module: str, base: BaseShapes | None) -> None:
    if module in _EMBEDDING_MODULES:
        raise LoRAAdapterError(
            f"adapter {name!r} targets {module}: LoRA on the embeddings or the LM head (tied "
            "or not) is not supported; target q/k/v/o_proj and gate/up/down_proj"
        )
    if base is not None and base.moe and module not in base.modules:
        raise LoRAAdapterError(
            f"adapter {name!r} targets the MLP ({module} or its experts): this base model's "
            "MLP is a mixture of experts, where LoRA is not supported; target q/k/v/o_proj"
        )
    if module not in SUPPORTED_MODULES:
        raise LoRAAdapterError(
            f"adapter {name!r} targets {module}, not one of {', '.join(SUPPORTED_MODULES)}"
        )


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    path = directory / "adapter_model.safetensors"
    if not path.is_file():
        raise LoRAAdapterError(f"no adapter_model.safetensors in {directory}")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise LoRAAdapterError(f"{path} is unreadable: {e}") from None
