"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama layer with q/k/v and gate/up stored fused in the
checkpoint (split here at load, so tensor parallelism and quantized linears see the usual
parts), partial rotary embeddings and LongRoPE (layers/rotary.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tokenmill.layers.rotary import rope_parameters
from tokenmill.models.family import Family, TensorReader
from tokenmill.models.traits import ArchitectureTraits


def phi3_traits(architecture: str, hf_config: Any) -> ArchitectureTraits:
    rope = rope_parameters(hf_config)
    rope.setdefault("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    rope.setdefault("max_position_embeddings", hf_config.max_position_embeddings)
    original = getattr(hf_config, "original_max_position_embeddings", None)
    rope.setdefault("original_max_position_embeddings", original)
    return ArchitectureTraits(
        qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        o_proj_bias=bool(getattr(hf_config, "attention_bias", False)),
        rope=rope,
    )


def split_fused(
    name: str, read: TensorReader, hf_config: Any
) -> Iterator[tuple[str, TensorReader]]:
    """`qkv_proj` -> q/k/v_proj and `gate_up_proj` -> gate/up_proj rows; other tensors as
    they are."""
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    kv = (getattr(hf_config, "num_key_value_heads", None) or heads) * head_dim
    if ".qkv_proj." in name:
        parts = (("q_proj", heads * head_dim), ("k_proj", kv), ("v_proj", kv))
        yield from _split(name, "qkv_proj", parts, read)
    elif ".gate_up_proj." in name:
        size = hf_config.intermediate_size
        yield from _split(name, "gate_up_proj", (("gate_proj", size), ("up_proj", size)), read)
    else:
        yield name, read


def _split(
    name: str, fused: str, parts: tuple[tuple[str, int], ...], read: TensorReader
) -> Iterator[tuple[str, TensorReader]]:
    start = 0
    for part, rows in parts:
        yield name.replace(f".{fused}.", f".{part}."), _rows_reader(read, start, rows)
        start += rows


def _rows_reader(read: TensorReader, start: int, rows: int) -> TensorReader:
    def read_rows(rank: Any) -> torch.Tensor:
        tensor = read(None).narrow(0, start, rows)
        if rank is None:
            return tensor
        return tensor.narrow(rank.dim, rank.start, rank.length).contiguous()

    return read_rows


FAMILY = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    traits=phi3_traits,
    gguf_architectures=("phi3",),
    split_tensor=split_fused,
)
