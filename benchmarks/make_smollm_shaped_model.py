"""Build (once) a random-weight Llama shaped like SmolLM2-135M (benchmarks/vs_llamacpp.py).

hidden 576, 30 layers, 9 query / 3 KV heads, MLP 1536, vocab 49152, tied embeddings, RoPE
theta 100000: the shape of HuggingFaceTB/SmolLM2-135M with random weights (no download). The
tokenizer is the built-in 2048-token one; token ids above it are valid inputs for the model
(benchmarks feed token ids, not text). Deterministic. Prints the model directory.

    python benchmarks/make_smollm_shaped_model.py
    # -> ~/.cache/tokenmill/bench-smollm2-135m-shaped-v1
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tokenmill.testing.random_checkpoint import cache_dir, save_random_checkpoint, train_tokenizer

NAME = "bench-smollm2-135m-shaped-v1"  # bump the version when changing the recipe


def build(save_dir: Path) -> None:
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        train_tokenizer(tokenizer_dir, vocab_size=2048)
        save_random_checkpoint(
            save_dir,
            "llama",
            tokenizer_dir=tokenizer_dir,
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            vocab_size=49152,
            tie_word_embeddings=True,
            rope_theta=100000.0,
            max_position_embeddings=2048,
            seed=0,
        )


def model_dir() -> Path:
    """The model's directory, built on first use."""
    final = cache_dir() / NAME
    if not final.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}.", dir=final.parent))
        try:
            build(tmp)
            tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


if __name__ == "__main__":
    print(model_dir())
