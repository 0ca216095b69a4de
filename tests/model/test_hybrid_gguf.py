"""Qwen3.5 GGUF files as llama.cpp's converter writes them (`qwen35`, `--no-mtp`): the same
greedy tokens as the checkpoint they were converted from, in float32, with the value heads
the converter tiles across key heads put back (2 key heads, 4 value heads here)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill_testing.llamacpp_convert import convert, llama_cpp_available

pytestmark = pytest.mark.skipif(
    not llama_cpp_available(), reason="no llama.cpp tree at ~/.cache/tokenmill-anchors"
)
MAX_TOKENS = 8
LINEAR = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_hidden_layers": 4,  # three linear layers, then one full attention
    "head_dim": 16,
}


def generate(model: Path, tokenizer: Path) -> list[list[int]]:
    llm = LLM(
        model=str(model),
        tokenizer=str(tokenizer),
        dtype="float32",
        max_model_len=64,
        block_size=4,
        num_kv_blocks=40,
        max_num_batched_tokens=7,
        max_num_seqs=4,
    )
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 6, 19, 33)]
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True
    )
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_converted_qwen35_gguf_gives_the_checkpoints_tokens(
    tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory
) -> None:
    checkpoint = tiny_checkpoint("qwen3_5", **LINEAR)
    gguf = convert(
        checkpoint, tmp_path_factory.mktemp("gguf") / "qwen35-f32.gguf", extra_args=("--no-mtp",)
    )
    assert generate(gguf, checkpoint) == generate(checkpoint, checkpoint)
