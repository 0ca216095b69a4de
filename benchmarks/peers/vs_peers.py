"""tokenmill against vLLM's CPU build and llama.cpp on the same weights, side by side.

    python -m benchmarks.peers [--engines tokenmill,tokenmill-bf16,vllm,llamacpp-bf16]
        [--batches 1,16,64] [--rounds 2] [--output table.md]            # offline, float
    python -m benchmarks.peers --quantization q8_0|q4_k_m
        [--engines tokenmill,llamacpp,tokenmill-w8a8,vllm-w8a8]          # offline, quantized
    python -m benchmarks.peers --online [--concurrency 1,8,32]
        [--engines tokenmill,vllm,llamacpp-bf16]                         # servers

Offline (offline.py): B requests of `--prompt-len` random prompt ids and `--gen-len`
generated tokens each (greedy, ignore_eos), all submitted at once; end-to-end output tok/s
(prefill included). tokenmill = `LLM(model, max_model_len=512)` with its defaults, vLLM =
`LLM(model, max_model_len=512, dtype="bfloat16")` (`VLLM_CPU_KVCACHE_SPACE=4` unless set),
both with `max_num_seqs` = the largest B; llama.cpp = `llama-batched-bench -npp P -ntg G
-npl B -t THREADS`. Below the table, the roofline: this machine's read bandwidth (torch.sum
over 256 MiB, best of 5, taken before and after the runs) and each engine's decode rate at
B = 1 without its prefill times the weight bytes a step reads (machine.step_bytes: the
active bytes, a mixture of experts' k of E routed experts, an untied embedding's one row left
out): achieved GB/s and its share of the roof.

`--quantization q8_0|q4_k_m` (issue 29): tokenmill loading one GGUF file of that type
(`LLM(model="x.gguf")`) against llama.cpp on the same file, and `tokenmill-w8a8` against
`vllm-w8a8` on one compressed-tensors W8A8 checkpoint (engines.py); with each
engine's resident memory after load, and tokenmill's weights within it, beside the file's
size (offline.py says how).

`--online` (online.py): each engine's OpenAI server (`tokenmill serve`, `vllm serve`,
`llama-server -np C -cb`) under `tokenmill bench serve` at each concurrency C: output tok/s,
TTFT, ITL and TPOT (p50, p99), and tokens per streamed chunk. With `--quantization` the
servers load the GGUF / W8A8 weights.

Every engine runs in processes of its own, one at a time; rounds interleave the engines so
that load from other jobs spreads over all of them; medians over rounds. An engine that fails
shows as such, with its error below the table, and the others still run. The output starts
with `lscpu`'s model and flags, the date and the command. The weights: the random
SmolLM2-135M-shaped checkpoint (`tokenmill bench make-model --preset smollm`) unless `--model`
(a directory, or a preset: `1b`, `3b` for Llama-3.2-1B / 3B shapes, widths multiples of 256); GGUF
conversions and the W8A8 checkpoint are made once and cached (llamacpp.py,
engines.py). The peers come from ../shared/anchors/ (vllm-cpu venv, llama.cpp build).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.peers.engines import DEFAULT_ENGINES, Engine, resolve_engines
from benchmarks.peers.machine import (
    gguf_tensor_types,
    lscpu_summary,
    read_bandwidth_gbs,
    step_bytes,
)
from benchmarks.peers.offline import OfflineResult, Resident, offline_run, resident_after_load
from benchmarks.peers.online import OnlineResult, concurrencies, online_run
from tokenmill.bench.llamacpp import QUANTIZED

ANCHORS = Path.home() / ".cache" / "tokenmill-anchors"
FAILURES = (RuntimeError, subprocess.SubprocessError)
MB = 1e6


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def cell(value: float | None, digits: int = 1) -> str:
    return "failed" if value is None else f"{value:.{digits}f}"


def ratio_pairs(engines: list[Engine], quantized: bool) -> list[tuple[Engine, Engine]]:
    """(tokenmill engine, another engine) pairs worth a ratio: on float weights every peer
    and the base tree; quantized, only engines on the same weight file."""
    subjects = [e for e in engines if e.runner == "tokenmill" and e.name != "tokenmill-base"]
    return [
        (a, b)
        for a in subjects
        for b in engines
        if b not in subjects and (not quantized or a.weights == b.weights)
    ]


def offline(engines: list[Engine], args: argparse.Namespace) -> str:
    """Every round of every engine, then (quantized) each one's memory: the tables."""
    roof = read_bandwidth_gbs()
    runs: dict[str, list[OfflineResult]] = {e.name: [] for e in engines}
    errors: dict[str, str] = {}
    for round_index in range(args.rounds):
        for engine in engines:
            try:
                result = offline_run(engine, args, seed=round_index)
            except FAILURES as e:
                errors[engine.name] = str(e)
                print(f"round {round_index} {engine.name}: failed: {e}", flush=True)
                continue
            runs[engine.name].append(result)
            rates = ", ".join(f"B={b} {r:.1f}" for b, r in result.rates.items())
            decode = "" if result.decode_steps_s is None else (
                f"; B=1 decode {result.decode_steps_s:.1f} steps/s"
            )  # fmt: skip
            print(f"round {round_index} {engine.name}: {rates} tok/s{decode}", flush=True)
    memory = {}
    if args.quantization:
        for engine in engines:
            try:
                memory[engine.name] = resident_after_load(engine, args)
            except FAILURES as e:
                errors.setdefault(engine.name, str(e))
    roof = max(roof, read_bandwidth_gbs())
    lines = offline_table(engines, args, runs, memory)
    if args.quantization:
        lines += ["", *weight_files(engines)]
    if 1 in {int(b) for b in args.batches.split(",")}:
        lines += ["", *roofline(engines, runs, roof)]
    return "\n".join(lines + notes(engines, errors))


def megabytes(value: int | None) -> str:
    return "-" if value is None else f"{value / MB:.0f}"


def offline_table(
    engines: list[Engine],
    args: argparse.Namespace,
    runs: dict[str, list[OfflineResult]],
    memory: dict[str, Resident | None],
) -> list[str]:
    """Medians of output tok/s per engine and batch size (and memory), then the ratios."""
    batches = [int(b) for b in args.batches.split(",")]
    rate = {
        (e.name, b): median_or_none([r.rates[b] for r in runs[e.name] if b in r.rates])
        for e in engines
        for b in batches
    }
    header = "| engine | " + " | ".join(f"B={b}" for b in batches) + " |"
    if args.quantization:
        header += " resident after load (MB) | of it weights (MB) |"
    lines = ["Output tok/s (prefill included):", "", header, "|---" * (header.count("|") - 1) + "|"]
    for engine in engines:
        row = f"| {engine.name} | " + " | ".join(cell(rate[(engine.name, b)]) for b in batches)
        if args.quantization:
            resident = memory.get(engine.name)
            weights = None if resident is None else resident.weight_bytes
            row += f" | {megabytes(resident and resident.process_bytes)} | {megabytes(weights)}"
        lines.append(row + " |")
    lines.append("")
    for a, b in ratio_pairs(engines, bool(args.quantization)):
        ratios = [(rate[(a.name, n)], rate[(b.name, n)]) for n in batches]
        text = ", ".join(f"{x / y:.2f}x" if x and y else "-" for x, y in ratios)
        lines.append(f"- {a.name} / {b.name}: {text} (B = {', '.join(map(str, batches))})")
    return lines


def weight_files(engines: list[Engine]) -> list[str]:
    """The size (and GGML types) of each weight file the engines load."""
    lines = []
    for weights in dict.fromkeys(e.weights for e in engines):
        if weights.suffix == ".gguf":
            tensor_bytes, types = gguf_tensor_types(weights)
            kinds = ", ".join(f"{t} x{n}" for t, n in sorted(types.items(), key=lambda x: -x[1]))
            size = weights.stat().st_size / MB
            lines.append(f"- `{weights.name}`: {size:.1f} MB, tensors {tensor_bytes / MB:.1f} MB"
                         f" ({kinds})")  # fmt: skip
        else:
            size = sum(f.stat().st_size for f in weights.glob("*.safetensors")) / MB
            lines.append(f"- `{weights.name}`: safetensors {size:.1f} MB")
    return lines


def roofline(engines: list[Engine], runs: dict[str, list[OfflineResult]], roof: float) -> list[str]:
    lines = [
        f"Roofline: streaming reads at {roof:.1f} GB/s (torch.sum over 256 MiB, best of 5). "
        "Decode at B = 1, prefill excluded; the bytes a step reads (k of E routed experts, an "
        "untied embedding table left out):",
        "",
        "| engine | weights read a step (MB) | decode steps/s | GB/s | of the roof |",
        "|---|---|---|---|---|",
    ]
    for engine in engines:
        decode = median_or_none([r.decode_steps_s for r in runs[engine.name] if r.decode_steps_s])
        float_bytes = runs[engine.name][0].float_bytes if runs[engine.name] else 4
        step = step_bytes(engine.weights, float_bytes)
        achieved = None if decode is None else step * decode / 1e9
        share = "-" if achieved is None else f"{achieved / roof:.0%}"
        lines.append(f"| {engine.name} | {step / MB:.0f} | {cell(decode)} | {cell(achieved)} "
                     f"| {share} |")  # fmt: skip
    return lines


def online(engines: list[Engine], args: argparse.Namespace) -> str:
    """Every round of every engine's server at every concurrency: the table."""
    from tokenmill.bench.llamacpp import whole_character_bias

    bias = whole_character_bias(Path(args.model))
    runs: dict[tuple[str, int], list[OnlineResult]] = {}
    errors: dict[str, str] = {}
    out = Path(args.log_dir or tempfile.mkdtemp(prefix="vs-peers-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"server logs and bench serve results under {out}", flush=True)
    for round_index in range(args.rounds):
        for engine in engines:
            try:
                results = online_run(engine, args, round_index, bias, out)
            except FAILURES as e:
                errors[engine.name] = str(e)
                print(f"round {round_index} {engine.name}: failed: {e}", flush=True)
                continue
            for c, result in results.items():
                runs.setdefault((engine.name, c), []).append(result)
                print(f"round {round_index} {engine.name} C={c}: {result.output_tok_s:.1f} "
                      f"tok/s, ITL p50 {result.itl_p50:.1f} ms", flush=True)  # fmt: skip
    return "\n".join(online_table(engines, args, runs) + notes(engines, errors))


def online_table(
    engines: list[Engine],
    args: argparse.Namespace,
    runs: dict[tuple[str, int], list[OnlineResult]],
) -> list[str]:
    """Medians per engine and concurrency, then tokenmill's ratios to each peer."""
    levels = concurrencies(args)
    fields = ("output_tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50")
    columns = "out tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 | tok/chunk"
    lines = ["Latencies in ms:", "", f"| engine | C | {columns} |", "|---" * 9 + "|"]
    medians: dict[tuple[str, int, str], float | None] = {}
    for engine, c in ((e, c) for e in engines for c in levels):
        results = runs.get((engine.name, c), [])
        for name in (*fields, "tokens_per_chunk"):
            medians[(engine.name, c, name)] = median_or_none([getattr(r, name) for r in results])
        cells = [cell(medians[(engine.name, c, f)]) for f in fields]
        cells.append(cell(medians[(engine.name, c, "tokens_per_chunk")], 2))
        lines.append(f"| {engine.name} | {c} | " + " | ".join(cells) + " |")
    lines.append("")
    for a, b in ratio_pairs(engines, bool(args.quantization)):
        for name, label in (("output_tok_s", "out tok/s"), ("itl_p50", "ITL p50"),
                            ("itl_p99", "ITL p99")):  # fmt: skip
            pairs = [(medians[(a.name, c, name)], medians[(b.name, c, name)]) for c in levels]
            text = ", ".join(f"{x / y:.2f}x" if x and y else "-" for x, y in pairs)
            lines.append(f"- {label}, {a.name} / {b.name}: {text} (C = {args.concurrency})")
    return lines


def notes(engines: list[Engine], errors: dict[str, str]) -> list[str]:
    """Engines not run with their defaults, then each failed engine's last error."""
    lines = [f"- {e.name}: {e.note}" for e in engines if e.note]
    if lines:
        lines.insert(0, "Not run with their defaults:")
    if errors:
        lines += ["", "Failures (last error of each engine):"]
    for name, error in errors.items():
        lines.append(f"- {name}: " + " | ".join(error.strip().splitlines()[-3:])[:600])
    return ["", *lines] if lines else []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", default=None, help="comma-separated (engines.py)")
    parser.add_argument("--online", action="store_true", help="servers under bench serve")
    parser.add_argument("--quantization", choices=tuple(QUANTIZED), default=None)
    parser.add_argument(
        "--model",
        default=None,
        help="a checkpoint directory, or a preset's name (smollm, 1b, 3b: "
        "tokenmill/bench/random_model.py, built once); default: smollm",
    )
    parser.add_argument("--batches", default="1,16,64", help="offline: requests at once")
    parser.add_argument("--concurrency", default="1,8,32", help="online: requests in flight")
    parser.add_argument("--prompts-per-concurrency", type=int, default=4, help="online")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp -t")
    parser.add_argument("--base-tree", type=Path, default=None, help="for tokenmill-base")
    parser.add_argument("--vllm-python", type=Path, default=ANCHORS / "vllm-cpu/bin/python")
    parser.add_argument("--llamacpp", type=Path, default=ANCHORS / "llama.cpp", help="its tree")
    parser.add_argument("--timeout", type=float, default=1800.0, help="s per engine process")
    parser.add_argument("--log-dir", default=None, help="online: server logs (default: a temp dir)")
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    args.engines = args.engines or DEFAULT_ENGINES[bool(args.quantization)]
    from tokenmill.bench.random_model import PRESETS

    preset = PRESETS.get(args.model or "smollm")
    if preset is not None:
        args.model = str(preset.model_dir())
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    try:
        engines = resolve_engines(args)  # converts and quantizes the weights on first use
    except FAILURES as e:
        raise SystemExit(f"vs_peers.py: could not prepare the engines' weights: {e}") from None
    model, flags = lscpu_summary()
    table = online(engines, args) if args.online else offline(engines, args)
    command = shlex.join(["python", "-m", "benchmarks.peers", *(argv or sys.argv[1:])])
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = f"{model}; flags: {flags}; {date}\n`{command}`\n\n{table}\n"
    print(text)
    if args.output is not None:
        args.output.write_text(text)
    return text


if __name__ == "__main__":
    main()
