"""`tokenmill bench embed`: embedding throughput of tokenmill's pooling engine against
sentence-transformers on the same machine, in the same process, rounds interleaved, medians
reported; and the p50 latency of one short text for each.

With no `--model`, a random-weight model of `--shape` is written once to the cache as a
sentence-transformers directory: `bge-small`, BAAI/bge-small-en-v1.5's (BERT, hidden 384, 12
layers, 12 heads, MLP 1536, 30522 tokens, CLS pooling, normalized), or `qwen3-embedding-0.6b`,
Qwen/Qwen3-Embedding-0.6B's (Qwen3, hidden 1024, 28 layers, 16 / 8 heads of 128, MLP 3072,
151669 tokens, tied, last-token pooling, normalized; the demo model's tokenizer). Texts are
random words of the tokenizer's vocabulary, each one token, so a text's length in tokens is
chosen (uniform in `--min-tokens..--max-tokens`; exactly for the BERT vocabulary). With
`--llama-cpp-bin`, llama.cpp's `llama-server --embedding` on the same weights joins the rounds
(embed_llamacpp.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill.bench.random_model import cache_dir, make_random_model, no_progress_bars

BGE_SMALL_SHAPE = dict(
    hidden_size=384,
    num_hidden_layers=12,
    num_attention_heads=12,
    intermediate_size=1536,
    vocab_size=30522,
    max_position_embeddings=512,
)
BGE_SMALL_NAME = "bench-bge-small-shaped-v1"
QWEN3_EMBEDDING_NAME = "bench-qwen3-embedding-0.6b-shaped-v1"
QWEN3_EMBEDDING_SHAPE = dict(
    architecture="Qwen3ForCausalLM",
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151669,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
)
SHAPES = ("bge-small", "qwen3-embedding-0.6b")
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
    _write_sentence_transformers_files(directory, shape, "pooling_mode_cls_token")


def _write_sentence_transformers_files(directory: Path, shape: dict[str, Any], mode: str) -> None:
    """modules.json (Transformer, Pooling by `mode`, Normalize) and the modules' configs."""
    parts = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(parts)
    ]
    (directory / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": shape["hidden_size"], mode: True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    (directory / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": shape["max_position_embeddings"], "do_lower_case": False})
    )


def random_texts(
    count: int,
    min_tokens: int,
    max_tokens: int,
    vocab: int,
    seed: int = 0,
    words: list[str] | None = None,
) -> list[str]:
    """`count` texts of random words (one token each: `w<i>` of the bench's BERT vocabulary
    of `vocab` tokens, or `words`), min..max tokens with the two special tokens the BERT
    tokenizer adds."""
    rng = random.Random(seed)
    pool = words or [f"w{i}" for i in range(vocab - len(_SPECIALS))]
    return [
        " ".join(rng.choice(pool) for _ in range(rng.randint(min_tokens, max_tokens) - 2))
        for _ in range(count)
    ]


def random_qwen3_embedder() -> Path:
    """A random decoder embedder of Qwen3-Embedding-0.6B's shape (models of random_model.py)
    with sentence-transformers' files for last-token pooling, normalized."""
    model = make_random_model(QWEN3_EMBEDDING_NAME, dict(QWEN3_EMBEDDING_SHAPE))
    if not (model / "modules.json").is_file():
        _write_sentence_transformers_files(model, QWEN3_EMBEDDING_SHAPE, "pooling_mode_lasttoken")
    return model


def single_token_words(model: Path) -> list[str] | None:
    """Words of the model's tokenizer that stay one token each between spaces; None for the
    bench's BERT vocabulary (its `w<i>` words)."""
    if (model / "vocab.txt").is_file():
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    vocab = sorted(tokenizer.get_vocab())
    words = [t[1:] for t in vocab if t.startswith("\u0120") and t[1:].isalpha()]
    if not words:
        return None  # not a byte-level BPE vocabulary: `w<i>` words, whatever they become
    one_token = tokenizer([" " + w for w in words], add_special_tokens=False)["input_ids"]
    return [w for w, ids in zip(words, one_token) if len(ids) == 1] or None


def add_embed_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="embedding model (default: a random one of --shape)"
    )
    parser.add_argument("--shape", choices=SHAPES, default="bge-small", help="the random model")
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
    parser.add_argument(
        "--llama-cpp-bin",
        type=Path,
        default=None,
        help="a llama.cpp build's binaries (in its source tree): llama-server --embedding on "
        "the same weights, f32 for float32 and bf16 otherwise, joins the rounds",
    )


def run_embed(args: argparse.Namespace) -> int:
    from tokenmill.config import EngineConfig
    from tokenmill.pooling.service import build_pooling_service

    if args.model:
        model = Path(args.model)
    else:
        model = random_embedder() if args.shape == "bge-small" else random_qwen3_embedder()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    words = single_token_words(model)
    texts = random_texts(args.num_texts, args.min_tokens, args.max_tokens, vocab, words=words)
    short = random_texts(1, 16, 16, vocab, seed=1, words=words)
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
    with contextlib.ExitStack() as peers:
        if args.llama_cpp_bin is not None:
            _add_llamacpp_runs(args, model, texts, short, runs, peers)
        report = _measure(args, model, texts, short, runs)
    print(json.dumps(report, indent=2))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _add_llamacpp_runs(
    args: argparse.Namespace,
    model: Path,
    texts: list[str],
    short: list[str],
    runs: dict[str, Any],
    peers: contextlib.ExitStack,
) -> None:
    """llama-server at each asked dtype's GGUF, fed the texts as the model's token ids
    (tokenized here, before the rounds: its rounds time no tokenization)."""
    from transformers import AutoConfig, AutoTokenizer

    from tokenmill.bench.embed_llamacpp import LlamaCppEmbedder
    from tokenmill.pooling.config import read_pooling_config

    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    ids = {tuple(b): tokenizer(b)["input_ids"] for b in (texts, texts[:8], short)}
    hf_config = AutoConfig.from_pretrained(str(model), local_files_only=True)
    is_decoder = not getattr(hf_config, "is_encoder_decoder", False) and hf_config.model_type in (
        "llama", "mistral", "qwen2", "qwen3"
    )  # fmt: skip
    pooling = read_pooling_config(model, hf_config, is_decoder)
    for kind in dict.fromkeys("float32" if d == "float32" else "bfloat16" for d in args.dtype):
        log = Path(tempfile.gettempdir()) / f"bench-embed-llama-server-{kind}.log"
        embed = peers.enter_context(
            LlamaCppEmbedder(
                args.llama_cpp_bin, model, kind, pooling.pooling_type, args.max_tokens, log
            )
        )
        runs[f"llama.cpp ({kind})"] = lambda batch, embed=embed: embed(ids[tuple(batch)])


def _measure(
    args: argparse.Namespace, model: Path, texts: list[str], short: list[str], runs: dict[str, Any]
) -> dict[str, Any]:
    for run in runs.values():
        run(texts[:8])  # warm-up: first calls allocate and pick kernels
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    latency: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run(texts)
            seconds[name].append(time.perf_counter() - start)
            short_latency = []
            for _ in range(9):
                start = time.perf_counter()
                run(short)
                short_latency.append(time.perf_counter() - start)
            latency[name].extend(short_latency)
            # Each round as it ends, so a run killed by a time limit still leaves its data.
            print(
                f"round {round_index + 1} {name}: {args.num_texts / seconds[name][-1]:.2f} texts/s"
                f" ({seconds[name][-1]:.1f} s), one short text p50"
                f" {1000 * statistics.median(short_latency):.1f} ms",
                file=sys.stderr,
                flush=True,
            )
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
    return report
