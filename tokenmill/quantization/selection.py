"""The one place a linear layer's method is chosen: from the weight format its checkpoint
tensors arrive in (or `--quantization`), the device, the dtype and the linear backend; and the
one list of weight formats (`WEIGHT_FORMATS`: each a module of this package, weight_format.py).

The decoder layers' linears take the checkpoint's format (or `--quantization`'s). The LM head
and the embedding choose their own, as llama.cpp does (its output tensor stays at higher
precision than the rest: the rows are the logits): a GGUF file's own types; with
`--quantization` int8 per output row, whatever the decoder's format (a float head would be
the largest weight streamed per token of a small model: SmolLM2-135M's is 28M of its 135M
weights); float for a pre-quantized Hugging Face checkpoint (its quantization_config leaves
the head out). The embedding is then a lookup into the same int8 rows (one copy for a tied
head; `layers/quantized_embedding.py`, `use_quantized_embedding` below).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.config import ConfigError
from tokenmill.layers.linear import (
    DenseLinearMethod,
    Linear,
    LinearMethod,
    cpu_dense_method,
)
from tokenmill.layers.quantized_embedding import QuantizedEmbedding
from tokenmill.quantization.int4 import INT4
from tokenmill.quantization.int8 import INT8
from tokenmill.quantization.mixed_parts import MixedPartsFormat
from tokenmill.quantization.weight_format import WeightFormat

logger = logging.getLogger(__name__)

# Every weight format, each one module of this package (weight_format.py): the one place a
# format is registered.
# A mixed name (a fused layer's parts in several formats) holds the others': looked up first.
WEIGHT_FORMATS: tuple[WeightFormat, ...] = (
    MixedPartsFormat(lambda name: find_format(name)),
    INT8,
    INT4,
)
# `--quantization` values -> the weight format of the decoder's linears.
ONLINE_FORMATS = {value: name for fmt in WEIGHT_FORMATS for value, name in fmt.online.items()}
# The LM head's and embedding's format under `--quantization` (module docstring).
ONLINE_HEAD_FORMAT = "int8"
HEAD_LAYERS = ("lm_head", "embed_tokens")


@dataclass
class LinearPlan:
    """What each linear layer will be. `formats` names a format per layer (tokenmill's layer
    name, e.g. `layers.0.self_attn.qkv_proj`, `lm_head`, `embed_tokens`) for pre-quantized
    checkpoints; `default` is the format of every other decoder linear and `head` that of the
    LM head and embedding (None: the model's dtype)."""

    dtype: torch.dtype
    device: torch.device
    linear_backend: str = "auto"
    default: str | None = None
    head: str | None = None
    formats: Mapping[str, str] = field(default_factory=dict)
    # (format, the fallback it gave) -> the layers whose shape the format's kernel cannot take
    instead: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    @classmethod
    def online(
        cls,
        dtype: torch.dtype,
        device: torch.device,
        linear_backend: str,
        quantization: str | None,
        tensor_parallel: bool,
    ) -> LinearPlan:
        """`--quantization`'s plan (the head stays float under tensor parallelism, where the
        vocabulary is sharded)."""
        default = online_format(quantization)
        head = ONLINE_HEAD_FORMAT if default is not None and not tensor_parallel else None
        return cls(dtype, device, linear_backend, default=default, head=head)

    def format_of(self, name: str) -> str | None:
        if name in self.formats:
            return self.formats[name]
        if name.startswith("layers."):
            return self.default
        return self.head if name in HEAD_LAYERS else None

    def choose(self, name: str, linear: nn.Linear) -> LinearMethod:
        return self.method(name, linear.out_features, linear.in_features)

    def method(self, name: str, out_features: int, in_features: int) -> LinearMethod:
        wanted = self.format_of(name)
        if wanted is None or wanted == "float":
            return self.dense()
        fmt = find_format(wanted)
        if fmt is None:
            raise ConfigError(f"unknown weight format {wanted!r} for {name}")
        on = self._dequantize_on(fmt, wanted)
        if fmt.fits(wanted, out_features, in_features, on) or fmt.fallback is None:
            return fmt.method(wanted, on)
        fallback = find_format(fmt.fallback)
        assert fallback is not None, f"{fmt.family}'s fallback {fmt.fallback} is not registered"
        layers = self.instead.setdefault((fmt.family, fmt.fallback), [])
        layers.append(f"{name} ({out_features}x{in_features})")
        return fallback.method(fmt.fallback, on)

    def embedding_format(self) -> str | None:
        """The embedding's format where it is a lookup into quantized rows: int8 anywhere,
        int4 where the native layout holds it (torch's int4 layout cannot be read back)."""
        wanted = self.format_of("embed_tokens")
        if wanted is None or wanted == "float" or self.device.type != "cpu":
            return None
        fmt = find_format(wanted)
        if fmt is not None and not fmt.embedding_lookup():
            return None
        return wanted

    def dense(self) -> LinearMethod:
        if self.linear_backend == "auto" and self.device.type == "cpu":
            return cpu_dense_method(self.dtype) or DenseLinearMethod(self.dtype)
        return DenseLinearMethod(self.dtype)

    def _dequantize_on(self, fmt: WeightFormat, wanted: str) -> torch.device | None:
        """The device whose torch ops dequantize `wanted` weights per product (off the CPU,
        or under `--linear-backend torch`: int_codes.py); None: the CPU's kernels,
        which must exist."""
        if self.device.type != "cpu" or self.linear_backend == "torch":
            return self.device
        if not fmt.kernel_available():
            raise ConfigError(f"this torch build lacks the CPU kernel for {wanted} weights")
        return None


def find_format(name: str) -> WeightFormat | None:
    """The registered format that owns the format name `name`, or None."""
    return next((fmt for fmt in WEIGHT_FORMATS if fmt.owns(name)), None)


def online_format(quantization: str | None) -> str | None:
    if quantization is None:
        return None
    if quantization not in ONLINE_FORMATS:
        raise ConfigError(f"unknown quantization {quantization!r}; one of {sorted(ONLINE_FORMATS)}")
    return ONLINE_FORMATS[quantization]


def weight_format_summary(model: nn.Module) -> str:
    """e.g. "int4-g32 (14 linears), int8 lm_head, int8 embed_tokens": what the start-up log,
    /v1/models and the dashboard report (the embedding only where it is quantized)."""
    decoder: Counter[str] = Counter()
    others = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name.startswith("embed_tokens."):
            continue
        if name.startswith("layers."):
            decoder[module.quant_method.weight_format] += 1
        else:
            others.append(f"{module.quant_method.weight_format} {name}")
    parts = [f"{fmt} ({count} linears)" for fmt, count in decoder.most_common()]
    embedding = getattr(model, "embed_tokens", None)
    if hasattr(embedding, "weight_format"):
        others.append(f"{embedding.weight_format} embed_tokens")
    return ", ".join(parts + others)


def log_plan(plan: LinearPlan, model: nn.Module) -> None:
    if plan.default is None and not plan.formats:
        return
    embedding = getattr(model.embed_tokens, "weight_format", str(plan.dtype).removeprefix("torch."))
    logger.info(
        "linear weights: %s; the LM head and the embedding choose their own format (embedding %s)",
        weight_format_summary(model),
        embedding,
    )
    for (family, fallback), layers in plan.instead.items():
        logger.info(
            "%s instead of %s for %d linears whose shape the %s kernel cannot take: %s",
            fallback,
            family,
            len(layers),
            family,
            ", ".join(layers),
        )


def use_quantized_embedding(model: nn.Module, plan: LinearPlan) -> dict[str, Linear]:
    """Replace `model.embed_tokens` by a `QuantizedEmbedding` where the plan quantizes it
    (before the weights load); returns {"embed_tokens": the Linear that loads its rows}."""
    fmt = plan.embedding_format()
    if fmt is None or model.tp.size > 1:
        return {}
    vocab_rows, hidden = model.embed_tokens.weight.shape
    head = model.lm_head
    tied = model.shape.tie_word_embeddings
    if tied and isinstance(head, Linear) and head.quant_method.weight_format == fmt:
        table, shared = head, True
    else:
        method = plan.method("embed_tokens", vocab_rows, hidden)
        table = Linear(hidden, vocab_rows, method, dtype=model.embed_tokens.weight.dtype)
        shared = False
    model.embed_tokens = QuantizedEmbedding(table, model.embed_tokens.weight.dtype, shared)
    return {"embed_tokens": table}
