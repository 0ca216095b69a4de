"""The config fields every GGUF architecture's transformers config takes from the file's sizes
(`GGUFCheckpoint.sizing_metadata`) and norm epsilon: one list, so a family's builder adds only
what its architecture changes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def sized_fields(sizes: Mapping[str, int], meta: Callable[..., Any]) -> dict[str, Any]:
    return dict(
        vocab_size=sizes["vocab_size"],
        hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"],
        num_hidden_layers=sizes["num_layers"],
        num_attention_heads=sizes["num_heads"],
        num_key_value_heads=sizes["num_kv_heads"],
        head_dim=sizes["head_dim"],
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=sizes["max_position"],
    )
