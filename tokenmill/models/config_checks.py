"""Checks of the config values that size a model, before anything is allocated from them.

Each value is a positive integer, divides what it must, and agrees with the tensors the
checkpoint holds (their shapes, read from the files' headers): a config.json or GGUF header
that says 2^31 layers, a 10^12-wide MLP or 0 heads is one line naming the key, not a
terabyte allocation or a ZeroDivisionError. Values are given by role (the names below), each
with the key the file spells it with, so one set of checks serves config.json and GGUF.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from math import prod
from typing import Any

from tokenmill.config import ConfigError

# role -> config.json key
HF_KEYS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
    "max_position": "max_position_embeddings",
}
# A role's value as a file gives it: (the key it is under, the value; None where absent).
Found = Mapping[str, tuple[str, Any]]
# A tensor's name (Hugging Face's, without `model.`) -> its shape, rows first; None where the
# stored shape is not the weight's (packed quantized data): it still counts as a layer's.
TensorShapes = Mapping[str, tuple[int, ...] | None]

# (tensor, dimension, the roles whose product that dimension must be), read in this order.
_TENSOR_DIMENSIONS = (
    ("embed_tokens.weight", 0, ("vocab_size",)),
    ("embed_tokens.weight", 1, ("hidden_size",)),
    ("layers.0.self_attn.q_proj.weight", 0, ("num_heads", "head_dim")),
    ("layers.0.self_attn.q_proj.weight", 1, ("hidden_size",)),
    ("layers.0.self_attn.k_proj.weight", 0, ("num_kv_heads", "head_dim")),
    ("layers.0.mlp.gate_proj.weight", 0, ("intermediate_size",)),
    ("layers.0.mlp.down_proj.weight", 1, ("intermediate_size",)),
)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ModelLoadError(ConfigError):
    """The checkpoint is missing something or holds something unexpected."""


def hf_sizing(config: Mapping[str, Any] | Any) -> dict[str, tuple[str, Any]]:
    """The sizing values of a config.json's contents or of a transformers config."""
    if isinstance(config, Mapping):
        return {role: (key, config.get(key)) for role, key in HF_KEYS.items()}
    return {role: (key, getattr(config, key, None)) for role, key in HF_KEYS.items()}


def check_values(found: Found, source: str) -> dict[str, int]:
    """The values present, each a positive integer, and dividing where they must."""
    values = {
        role: _positive_int(value, key, source)
        for role, (key, value) in found.items()
        if value is not None
    }
    keys = {role: key for role, (key, _) in found.items()}
    heads, kv_heads = values.get("num_heads"), values.get("num_kv_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise ModelLoadError(
            f"{source}: {keys['num_heads']}={heads} is not a multiple of "
            f"{keys['num_kv_heads']}={kv_heads} (each KV head serves a whole group of heads)"
        )
    hidden, head_dim = values.get("hidden_size"), values.get("head_dim")
    head_dim_name = f"{keys['head_dim']}={head_dim}"
    if head_dim is None and hidden is not None and heads is not None:
        head_dim_name = f"{keys['hidden_size']} / {keys['num_heads']} = {hidden} / {heads}"
        if hidden % heads:
            raise ModelLoadError(
                f"{source}: {keys['hidden_size']}={hidden} is not a multiple of "
                f"{keys['num_heads']}={heads}, and no {keys['head_dim']} is given"
            )
        head_dim = hidden // heads
    if head_dim is not None and head_dim % 2:
        raise ModelLoadError(
            f"{source}: the head dimension ({head_dim_name}) must be even: RoPE rotates "
            "pairs of dimensions"
        )
    return values


def check_sizes(found: Found, shapes: TensorShapes, source: str) -> dict[str, int]:
    """Every role's value, checked against each other and the tensors; where the file leaves
    one out, what it implies (KV heads: the heads; head_dim: hidden / heads; vocabulary: the
    embedding's rows)."""
    values = check_values(found, source)
    keys = {role: key for role, (key, _) in found.items()}
    embedding = shapes.get("embed_tokens.weight")
    if "embed_tokens.weight" not in shapes:
        raise ModelLoadError(f"{source}: the checkpoint has no token embedding tensor")
    values.setdefault("num_kv_heads", values.get("num_heads", 0))
    if "head_dim" not in values and "num_heads" in values and "hidden_size" in values:
        values["head_dim"] = values["hidden_size"] // values["num_heads"]
    if "vocab_size" not in values and embedding is not None:
        values["vocab_size"] = embedding[0]
    missing = [keys[role] for role in keys if not values.get(role)]
    if missing:
        raise ModelLoadError(f"{source} lacks {', '.join(missing)}")
    _check_layers(values["num_layers"], keys["num_layers"], shapes, source)
    for tensor, dim, roles in _TENSOR_DIMENSIONS:
        shape = shapes.get(tensor)
        expected = prod(values[role] for role in roles)
        if shape is not None and (len(shape) <= dim or shape[dim] != expected):
            raise ModelLoadError(
                f"{source}: {_describe(roles, values, keys)}, but the tensor {tensor} has "
                f"shape {shape} ({'rows' if dim == 0 else 'columns'} must be {expected})"
            )
    return values


def _check_layers(num_layers: int, key: str, shapes: TensorShapes, source: str) -> None:
    held = 1 + max((int(m.group(1)) for name in shapes if (m := _LAYER.search(name))), default=-1)
    if num_layers != held:
        raise ModelLoadError(
            f"{source}: {key} is {num_layers}, but the checkpoint's tensors hold {held} layers"
        )


def _describe(roles: tuple[str, ...], values: Mapping[str, int], keys: Mapping[str, str]) -> str:
    """`hidden_size is 96` or `num_attention_heads x head_dim is 4 x 16`."""
    names = " x ".join(keys[role] for role in roles)
    numbers = " x ".join(str(values[role]) for role in roles)
    return f"{names} is {numbers}"


def _positive_int(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value
