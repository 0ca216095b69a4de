"""`tokenmill bench embed`: embedding throughput of tokenmill's pooling engine against
sentence-transformers on the same machine, in the same process, rounds interleaved, medians
reported; and the p50 latency of one short text for each.

With no `--model`, a random-weight model of BAAI/bge-small-en-v1.5's shape (BERT, hidden 384,
12 layers, 12 heads, MLP 1536, 30522 tokens, CLS pooling, normalized) is written once to the
cache as a sentence-transformers directory. Texts are random words of its vocabulary, each one
token, so a text's length in tokens is chosen exactly (uniform in `--min-tokens..--max-tokens`).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill.bench.random_model import cache_dir, no_progress_bars

BGE_SMALL_SHAPE = dict(
    hidden_size=384,
    num_hidden_layers=12,
    num_attention_heads=12,
    intermediate_size=1536,
    vocab_size=30522,
    max_position_embeddings=512,
)
BGE_SMALL_NAME = "bench-bge-small-shaped-v1"
_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def random_embedder(name: str = BGE_SMALL_NAME, shape: dict[str, Any] | None = None) -> Path:
    """A random BERT embedder as a sentence-transformers directory (CLS pooling, Normalize),
    built once in the cache."""
    final = cache_dir() / name
    if (final / "modules.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        _write_embedder(tmp, dict(shape or BGE_SMALL_SHAPE))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_embedder(directory: Path, shape: dict[str, Any]) -> None:
    import torch
    import transformers

    words = [f"w{i}" for i in range(shape["vocab_size"] - len(_SPECIALS))]
    (directory / "vocab.txt").write_text("\n".join([*_SPECIALS, *words]) + "\n")
    tokenizer = transformers.BertTokenizerFast(
        str(directory / "vocab.txt"), model_max_length=shape["max_position_embeddings"]
    )
    config = transformers.BertConfig(**shape)
    config.architectures = ["BertModel"]
    with torch.random.fork_rng(devices=[]), no_progress_bars():
        torch.manual_seed(0)
        model = transformers.BertModel(config, add_pooling_layer=False)
        model.eval().save_pretrained(str(directory))
        tokenizer.save_pretrained(str(directory))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    (directory / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": shape["hidden_size"], "pooling_mode_cls_token": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (directory / "2_Normalize").mkdir()
    (directory / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": shape["max_position_embeddings"], "do_lower_case": False})
    )


def random_texts(
    count: int, min_tokens: int, max_tokens: int, vocab: int, seed: int = 0
) -> list[str]:
    """`count` texts of random words `w<i>` (one token each), min..max tokens with the two
    special tokens the tokenizer adds."""
    rng = random.Random(seed)
    words = vocab - len(_SPECIALS)
    return [
        " ".join(f"w{rng.randrange(words)}" for _ in range(rng.randint(min_tokens, max_tokens) - 2))
        for _ in range(count)
    ]


def add_embed_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="embedding model (default: bge-small-shaped random)"
    )
    parser.add_argument("--num-texts", type=int, default=1000, help="texts each round embeds")
    parser.add_argument(
        "--min-tokens", type=int, default=16, help="shortest text, in tokens (specials included)"
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="longest text, in tokens")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each, interleaved")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["float32"],
        help="tokenmill's compute dtype(s), each measured (auto: what `serve` picks)",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="tokenmill's token budget a step"
    )
    parser.add_argument(
        "--st-batch-size", type=int, default=32, help="sentence-transformers' batch"
    )
    parser.add_argument("--no-sentence-transformers", action="store_true", help="tokenmill alone")
    parser.add_argument("--output-json", type=Path, default=None, help="also write the report here")


def run_embed(args: argparse.Namespace) -> int:
    from tokenmill.config import EngineConfig
    from tokenmill.pooling.service import build_pooling_service

    model = Path(args.model) if args.model else random_embedder()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    texts = random_texts(args.num_texts, args.min_tokens, args.max_tokens, vocab)
    runs: dict[str, Any] = {}
    for dtype in args.dtype:
        config = EngineConfig(
            model=str(model), dtype=dtype, max_num_batched_tokens=args.max_num_batched_tokens
        )
        service = build_pooling_service(config, "embed")
        runs[f"tokenmill ({dtype})"] = lambda batch, service=service: service.run(
            [service.prompts.embed(t) for t in batch]
        )
    if not args.no_sentence_transformers:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(model), device="cpu")
        runs["sentence-transformers"] = lambda batch: st.encode(
            batch, batch_size=args.st_batch_size, show_progress_bar=False
        )
    for run in runs.values():
        run(texts[:8])  # warm-up: first calls allocate and pick kernels
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    latency: dict[str, list[float]] = {name: [] for name in runs}
    short = random_texts(1, 16, 16, vocab, seed=1)
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run(texts)
            seconds[name].append(time.perf_counter() - start)
            for _ in range(9):
                start = time.perf_counter()
                run(short)
                latency[name].append(time.perf_counter() - start)
    report = {
        "model": str(model),
        "num_texts": args.num_texts,
        "tokens": f"{args.min_tokens}-{args.max_tokens}",
        "results": {
            name: {
                "texts_per_s": args.num_texts / statistics.median(seconds[name]),
                "rounds_s": [round(s, 3) for s in seconds[name]],
                "p50_latency_ms_16_tokens": 1000 * statistics.median(latency[name]),
            }
            for name in runs
        },
    }
    if "sentence-transformers" in runs:
        theirs = report["results"]["sentence-transformers"]["texts_per_s"]
        report["speedup_vs_sentence_transformers"] = {
            name: report["results"][name]["texts_per_s"] / theirs
            for name in runs
            if name != "sentence-transformers"
        }
    print(json.dumps(report, indent=2))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
