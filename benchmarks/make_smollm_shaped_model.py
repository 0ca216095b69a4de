"""Build (once) a random-weight Llama shaped like SmolLM2-135M (benchmarks/vs_peers.py).

hidden 576, 30 layers, 9 query / 3 KV heads, MLP 1536, vocab 49152, tied embeddings, RoPE
theta 100000: the shape of HuggingFaceTB/SmolLM2-135M with random weights (no download). The
tokenizer is the built-in 2048-token one; token ids above it are valid inputs for the model
(benchmarks feed token ids, not text). Deterministic. Prints the model directory.

    python benchmarks/make_smollm_shaped_model.py
    # -> ~/.cache/tokenmill/bench-smollm2-135m-shaped-v1
"""

from __future__ import annotations

from pathlib import Path

from make_bench_model import cached_random_model

NAME = "bench-smollm2-135m-shaped-v1"  # bump the version when changing the recipe
SHAPE = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    max_position_embeddings=2048,
)


def model_dir() -> Path:
    """The model's directory, built on first use."""
    return cached_random_model(NAME, **SHAPE)


if __name__ == "__main__":
    print(model_dir())
