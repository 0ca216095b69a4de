"""The benchmarks' random-weight Llama checkpoints, by preset, each built once into the cache.

    python -m benchmarks.models --preset bench    # -> ~/.cache/tokenmill/bench-random-llama-79m-v1
    python -m benchmarks.models --preset smollm   # SmolLM2-135M's shape
    python -m benchmarks.models --preset 1b       # Llama-3.2-1B's shape

Presets (deterministic: the same files every time; prints the model directory):
- `bench`: the 79M Llama docs/benchmarks.md batches with. The built-in default model is so
  small that a forward pass costs less than streaming its tokens over HTTP, so batching
  barely shows in serving throughput; this one is big enough for the forward pass to dominate
  on a CPU, small enough to serve on two cores.
- `smollm`: hidden 576, 30 layers, 9 query / 3 KV heads, MLP 1536, vocab 49152, tied
  embeddings, RoPE theta 100000: HuggingFaceTB/SmolLM2-135M's shape with random weights (no
  download), as benchmarks/peers compares.
- `1b`: hidden 2048, 16 layers, 32 query / 8 KV heads, MLP 8192, vocab 49152, tied, saved in
  bfloat16 (2.5 GB): Llama-3.2-1B's shape, widths that are multiples of 256, so
  `llama-quantize` writes real K-quant blocks (576 is not, and got Q5_0 / Q8_0 fallbacks).

The tokenizer is the built-in 2048-token one; token ids above it are valid inputs for the
larger vocabularies (benchmarks feed token ids, not text). Bump a preset's name's version when
changing its recipe.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill_testing.random_checkpoint import cache_dir, save_random_checkpoint, train_tokenizer


@dataclass(frozen=True)
class Preset:
    name: str  # the cache directory's name
    shape: dict[str, object]  # save_random_checkpoint's keyword arguments

    def model_dir(self) -> Path:
        """The model's directory, built on first use."""
        return cached_random_model(self.name, **self.shape)


BENCH = Preset(
    "bench-random-llama-79m-v1",
    dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        max_position_embeddings=2048,
    ),
)
SMOLLM = Preset(
    "bench-smollm2-135m-shaped-v1",
    dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        max_position_embeddings=2048,
    ),
)
LLAMA_1B = Preset(
    "bench-llama-1b-shaped-v1",
    dict(
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
    ),
)
PRESETS = {"bench": BENCH, "smollm": SMOLLM, "1b": LLAMA_1B}


def cached_random_model(name: str, **shape: object) -> Path:
    """A random-weight Llama of `shape` with the built-in model's 2048-token tokenizer, built
    once into the cache directory under `name` (bump its version when changing the recipe)."""
    final = cache_dir() / name
    if not final.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=final.parent))
        try:
            with tempfile.TemporaryDirectory() as tokenizer_dir:
                train_tokenizer(tokenizer_dir, vocab_size=2048)
                save_random_checkpoint(tmp, "llama", tokenizer_dir=tokenizer_dir, seed=0, **shape)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=PRESETS, default="bench")
    print(PRESETS[parser.parse_args().preset].model_dir())


if __name__ == "__main__":
    main()
