"""KV + state memory of a hybrid model (Qwen3.5) at long contexts against dense models, from the
engine's own `KVCacheSpec` and `LinearStateSpec` (what the assembly takes out of the budget).

    python -m benchmarks.hybrid_memory [--preset qwen35-0.8b] [--contexts 4096,32768,131072]

Rows: the hybrid (KV of its full-attention layers, bf16, plus one sequence's state slot: conv
state in bf16, recurrent state in float32); the same shape with every layer attending (a
dense model of the same size and widths); and Qwen3-0.6B (28 layers, 8 KV heads of 128), the
dense model of about the same parameter count. One sequence; states are per sequence, so B
sequences multiply every cell by B. No weights are built: the preset's config alone.
"""

from __future__ import annotations

import argparse

import torch

from tokenmill.layers.kv_cache import KVCacheSpec
from tokenmill.models.gated_deltanet import linear_state_spec

GIB, MIB = 2**30, 2**20
KV_DTYPE = torch.bfloat16
# Qwen3-0.6B: the dense model of about Qwen3.5-0.8B's size (layers, KV heads, head dim).
DENSE_PEER = ("Qwen3-0.6B (dense)", 28, 8, 128)


def kv_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int) -> int:
    """A paged KV cache holding `tokens` tokens (block size 1: no partial block)."""
    return KVCacheSpec(layers, 1, kv_heads, head_dim, KV_DTYPE).bytes_per_block * tokens


def rows(preset: str, contexts: list[int]) -> list[tuple[str, list[tuple[int, int]]]]:
    """(model, [(KV bytes, state bytes) per context])."""
    from transformers import Qwen3_5TextConfig

    from tokenmill.bench.random_model import PRESETS

    shape = dict(PRESETS[preset].shape)
    for key in ("architecture", "config_class", "dtype"):
        shape.pop(key, None)
    config = Qwen3_5TextConfig(**shape)
    linear = sum(kind == "linear_attention" for kind in config.layer_types)
    full = config.num_hidden_layers - linear
    state = linear_state_spec(config, linear, KV_DTYPE).bytes_per_slot
    heads, head_dim = config.num_key_value_heads, config.head_dim
    name, peer_layers, peer_heads, peer_dim = DENSE_PEER
    return [
        (f"{preset} (hybrid, {full} of {config.num_hidden_layers} layers attend)",
         [(kv_bytes(full, heads, head_dim, n), state) for n in contexts]),
        (f"same shape, all {config.num_hidden_layers} layers attend",
         [(kv_bytes(config.num_hidden_layers, heads, head_dim, n), 0) for n in contexts]),
        (name, [(kv_bytes(peer_layers, peer_heads, peer_dim, n), 0) for n in contexts]),
    ]  # fmt: skip


def size(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / MIB:.1f} MiB"


def table(preset: str, contexts: list[int]) -> str:
    header = "| model | " + " | ".join(f"{n // 1024}k: KV + state" for n in contexts) + " |"
    lines = [header, "|---" * (len(contexts) + 1) + "|"]
    for model, cells in rows(preset, contexts):
        text = [f"{size(kv)} + {size(state)} = **{size(kv + state)}**" if state else
                f"**{size(kv)}**" for kv, state in cells]  # fmt: skip
        lines.append(f"| {model} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="qwen35-0.8b")
    parser.add_argument("--contexts", default="4096,32768,131072")
    args = parser.parse_args()
    print(table(args.preset, [int(n) for n in args.contexts.split(",")]))


if __name__ == "__main__":
    main()
