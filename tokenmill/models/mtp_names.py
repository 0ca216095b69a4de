"""Which checkpoint tensors are a model's multi-token-prediction (MTP) layers: DeepSeek-V3's
`model.layers.{N}.*` past its `num_hidden_layers`, Qwen3-Next's `mtp.*`. The target's loader
and its config checks skip them; `spec_decode/mtp_checkpoint.py` reads them as a draft."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from tokenmill.models.config_checks import TensorShapes
from tokenmill.models.safetensors_files import tensor_shapes

# config.json keys giving the number of MTP layers (DeepSeek-V3 and Qwen3-Next; Qwen3.5).
MTP_LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
T = TypeVar("T")


def num_mtp_layers(config: Any) -> int:
    """MTP layers a config (a dict or a transformers config) declares; 0 if none."""
    for key in MTP_LAYER_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def mtp_layer_index(name: str, num_layers: int, num_mtp: int) -> int | None:
    """The MTP layer (0, 1, ...) a tensor belongs to, or None for the model's own tensors."""
    if name.startswith("mtp."):
        return 0 if num_mtp else None
    match = _LAYER.match(name)
    if match is None or not num_mtp:
        return None
    index = int(match.group(1)) - num_layers
    return index if 0 <= index < num_mtp else None


def without_mtp(items: Iterable[tuple[str, T]], config: Any) -> Iterator[tuple[str, T]]:
    """(name, value) pairs of the model's own tensors: MTP layers left out."""
    num_mtp = num_mtp_layers(config)
    layers = config.get("num_hidden_layers") if isinstance(config, dict) else None
    layers = layers if layers is not None else getattr(config, "num_hidden_layers", 0)
    for name, value in items:
        if mtp_layer_index(name, layers, num_mtp) is None:
            yield name, value


def own_tensor_shapes(model_dir: Path, config: Any) -> TensorShapes:
    """The shapes of the checkpoint's tensors (`safetensors_files.tensor_shapes`) less its
    MTP layers', which the model's config does not size."""
    return dict(without_mtp(tensor_shapes(model_dir).items(), config))
