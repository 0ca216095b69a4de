"""`tokenmill bench embed` end to end on a tiny embedder: a report with both engines' rates."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill.bench.embed import add_embed_args, random_texts, run_embed


def test_random_texts_have_the_asked_token_counts() -> None:
    texts = random_texts(20, 16, 32, vocab=1000)
    assert all(14 <= len(t.split()) <= 30 for t in texts)
    assert len(set(texts)) == 20


def test_random_texts_from_a_word_list() -> None:
    texts = random_texts(10, 8, 8, vocab=0, words=["apple", "pear"])
    assert all(len(t.split()) == 6 and set(t.split()) <= {"apple", "pear"} for t in texts)


def test_llama_cpp_peer_refuses_a_pooling_it_lacks(tmp_path: Path) -> None:
    from tokenmill.bench.embed_llamacpp import LlamaCppEmbedder

    with pytest.raises(ValueError, match="llama-server pools"):
        LlamaCppEmbedder(tmp_path, tmp_path, "float32", "max", 64, tmp_path / "log")


@pytest.mark.slow(reason="timed rounds of two engines (about 10 s)")
def test_bench_embed_reports_both_engines(
    pooling_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    parser = argparse.ArgumentParser()
    add_embed_args(parser)
    out = tmp_path / "report.json"
    model = pooling_checkpoint("sentence_transformer")
    args = parser.parse_args(
        ["--model", str(model), "--num-texts", "6", "--min-tokens", "4", "--max-tokens", "16",
         "--rounds", "1", "--output-json", str(out)]
    )  # fmt: skip
    assert run_embed(args) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"tokenmill (float32)", "sentence-transformers"}
    assert report["results"]["tokenmill (float32)"]["texts_per_s"] > 0
    assert report["speedup_vs_sentence_transformers"]["tokenmill (float32)"] > 0
