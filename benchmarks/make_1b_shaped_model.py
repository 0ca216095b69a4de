"""Build (once) a random-weight Llama shaped like Llama-3.2-1B (benchmarks/vs_peers.py
`--model 1b`): widths that are multiples of 256, so `llama-quantize` writes real K-quant
blocks (the 135M shape's 576 is not, and got Q5_0 / Q8_0 fallbacks).

hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192, vocab 49152, tied embeddings, saved
in bfloat16 (2.5 GB). The tokenizer is the built-in 2048-token one (benchmarks feed token
ids). Deterministic. Prints the model directory.

    python benchmarks/make_1b_shaped_model.py  # -> ~/.cache/tokenmill/bench-llama-1b-shaped-v1
"""

from __future__ import annotations

from pathlib import Path

import torch
from make_bench_model import cached_random_model

NAME = "bench-llama-1b-shaped-v1"  # bump the version when changing the recipe
SHAPE = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    max_position_embeddings=2048,
    dtype=torch.bfloat16,
)


def model_dir() -> Path:
    """The model's directory, built on first use."""
    return cached_random_model(NAME, **SHAPE)


if __name__ == "__main__":
    print(model_dir())
