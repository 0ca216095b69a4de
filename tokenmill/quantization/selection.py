"""The one place a linear layer's method is chosen: from the weight format its checkpoint
tensors arrive in (or `--quantization`), the device, the dtype and the linear backend.

Only the decoder layers' linears are quantized. The LM head keeps the model's dtype (as
llama.cpp keeps its output tensor at higher precision: its rows are the logits), and so does
the embedding (a lookup, not a product).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.config import ConfigError
from tokenmill.layers.int4_linear import Int4LinearMethod, int4_linear_available
from tokenmill.layers.int8_linear import Int8LinearMethod, int8_linear_available
from tokenmill.layers.linear import (
    DenseLinearMethod,
    Linear,
    LinearMethod,
    cpu_dense_method,
)

logger = logging.getLogger(__name__)

# `--quantization` values -> the weight format of the decoder's linears.
ONLINE_FORMATS = {"int8": "int8", "int4": "int4-g32", "int4-g128": "int4-g128"}
# Rows of an int4 weight must divide into the kernel's tiles.
_INT4_ROW_MULTIPLE = 16


@dataclass
class LinearPlan:
    """What each linear layer will be. `formats` names a format per layer (tokenmill's layer
    name, e.g. `layers.0.self_attn.qkv_proj`) for pre-quantized checkpoints; `default` is
    the format of every other decoder linear (None: the model's dtype)."""

    dtype: torch.dtype
    device: torch.device
    linear_backend: str = "auto"
    default: str | None = None
    formats: Mapping[str, str] = field(default_factory=dict)
    int8_instead: list[str] = field(default_factory=list)

    def choose(self, name: str, linear: nn.Linear) -> LinearMethod:
        wanted = self.formats.get(name, self.default) if name.startswith("layers.") else None
        if wanted is None or wanted == "float":
            return self.dense()
        self._check_device(wanted)
        if wanted.startswith("int4-g"):
            group_size = int(wanted.removeprefix("int4-g"))
            if _fits_int4(linear, group_size):
                return Int4LinearMethod(group_size)
            self.int8_instead.append(f"{name} ({linear.out_features}x{linear.in_features})")
            return Int8LinearMethod()
        if wanted == "int8":
            return Int8LinearMethod()
        raise ConfigError(f"unknown weight format {wanted!r} for {name}")

    def dense(self) -> LinearMethod:
        if self.linear_backend == "auto" and self.device.type == "cpu":
            return cpu_dense_method(self.dtype) or DenseLinearMethod(self.dtype)
        return DenseLinearMethod(self.dtype)

    def _check_device(self, wanted: str) -> None:
        if self.device.type != "cpu":
            raise ConfigError(
                f"{wanted} weights run on the CPU only for now (torch's CPU kernels); "
                f"this engine runs on {self.device}"
            )
        int4 = wanted.startswith("int4")
        if not (int4_linear_available() if int4 else int8_linear_available()):
            raise ConfigError(f"this torch build lacks the CPU kernel for {wanted} weights")


def _fits_int4(linear: nn.Linear, group_size: int) -> bool:
    return linear.in_features % group_size == 0 and linear.out_features % _INT4_ROW_MULTIPLE == 0


def online_format(quantization: str | None) -> str | None:
    if quantization is None:
        return None
    if quantization not in ONLINE_FORMATS:
        raise ConfigError(f"unknown quantization {quantization!r}; one of {sorted(ONLINE_FORMATS)}")
    return ONLINE_FORMATS[quantization]


def weight_format_summary(model: nn.Module) -> str:
    """e.g. "int4-g32 (14 linears), bfloat16 lm_head": what the start-up log and /v1/models
    report."""
    decoder: Counter[str] = Counter()
    others = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if name.startswith("layers."):
            decoder[module.quant_method.weight_format] += 1
        else:
            others.append(f"{module.quant_method.weight_format} {name}")
    parts = [f"{fmt} ({count} linears)" for fmt, count in decoder.most_common()]
    return ", ".join(parts + others)


def log_plan(plan: LinearPlan, model: nn.Module) -> None:
    if plan.default is None and not plan.formats:
        return
    logger.info(
        "linear weights: %s; the embedding and LM head keep their own format (%s)",
        weight_format_summary(model),
        str(plan.dtype).removeprefix("torch."),
    )
    if plan.int8_instead:
        logger.info(
            "int8 instead of int4 for %d linears whose shape the int4 kernel cannot take: %s",
            len(plan.int8_instead),
            ", ".join(plan.int8_instead),
        )
