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

from tokenmill.testing.random_checkpoint import cache_dir, save_random_checkpoint, train_tokenizer

NAME = "bench-random-llama-79m-v1"  # bump the version when changing the recipe


def build(save_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        train_tokenizer(tokenizer_dir, vocab_size=2048)  # the built-in model's tokenizer
        save_random_checkpoint(
            save_dir,
            "llama",
            tokenizer_dir=tokenizer_dir,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            num_key_value_heads=4,
            intermediate_size=2048,
            max_position_embeddings=2048,
            seed=0,
        )


def main() -> None:
    final = cache_dir() / NAME
    if not final.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}.", dir=final.parent))
        try:
            build(tmp)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(final)


if __name__ == "__main__":
    main()
