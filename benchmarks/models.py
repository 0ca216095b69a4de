"""Build (once) the random-weight 79M-parameter Llama that docs/benchmarks.md batches with.

The built-in default model is so small that a forward pass costs less than streaming its
tokens over HTTP, so the scheduler's batching barely shows in serving throughput. This one is
big enough for the forward pass to dominate on a CPU, small enough to serve on two cores.
Deterministic: the same files every time. Prints the model directory.

    python benchmarks/make_bench_model.py  # -> ~/.cache/tokenmill/bench-random-llama-79m-v1
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import repo_root  # noqa: F401 (tokenmill_testing/, demo_training/ on sys.path)

from tokenmill_testing.random_checkpoint import cache_dir, save_random_checkpoint, train_tokenizer

NAME = "bench-random-llama-79m-v1"  # bump the version when changing the recipe


SHAPE = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    intermediate_size=2048,
    max_position_embeddings=2048,
)


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
    print(cached_random_model(NAME, **SHAPE))


if __name__ == "__main__":
    main()
