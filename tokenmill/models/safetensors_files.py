"""A Hugging Face checkpoint's safetensors files (one, or shards named by an index), opened
with one clear line for a missing or cut-short file, and the shapes their headers give."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from tokenmill.models.config_checks import ModelLoadError, TensorShapes

INDEX_FILE = "model.safetensors.index.json"
# Stored types whose shape is the weight's (others hold packed quantized data).
_WEIGHT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I8"}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not names:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    for name in names:
        if not (model_dir / name).is_file():
            raise ModelLoadError(f"{INDEX_FILE} names {name}, which is missing from {model_dir}")
    return [model_dir / name for name in names]


@contextmanager
def open_safetensors(path: Path) -> Iterator[Any]:
    """`safe_open` (PyTorch tensors, on the CPU); a broken file is one `ModelLoadError`."""
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as e:
        raise ModelLoadError(
            f"{path} is not a complete safetensors file ({e}); it may be truncated by an "
            "interrupted download: fetch it again"
        ) from e


def tensor_shapes(model_dir: Path) -> TensorShapes:
    """Each tensor's name (without `model.`) -> its shape (None for packed data), from the
    headers alone."""
    shapes: dict[str, tuple[int, ...] | None] = {}
    for path in checkpoint_files(model_dir):
        with open_safetensors(path) as f:
            for name in f.keys():  # noqa: SIM118  (safe_open has keys(), not __iter__)
                part = f.get_slice(name)
                weight_shaped = part.get_dtype() in _WEIGHT_DTYPES
                shape = tuple(part.get_shape()) if weight_shaped else None
                shapes[name.removeprefix("model.")] = shape
    return shapes
