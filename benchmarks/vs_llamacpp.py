"""tokenmill against llama.cpp on the same weights: end-to-end output tokens/s, interleaved.

    python benchmarks/vs_llamacpp.py [--llamacpp DIR] [--model PATH] [--batches 1,16,64]
        [--dtypes float32,bfloat16] [--repeats 2] [--output table.md]

B requests of `--prompt-len` random prompt tokens and `--gen-len` generated tokens each (greedy,
ignore_eos), all submitted at once; output tokens/s including prefill, median of `--repeats`
rounds. Each round measures every configuration once, in turn, so load from other jobs on a
shared machine spreads over all of them; compare ratios within a run, not across runs.

tokenmill: `LLM(...).generate` with default engine settings and `max_model_len=512`.
llama.cpp (only with `--llamacpp DIR`, a llama.cpp source tree built as docs/benchmarks.md
says, with `DIR/build/bin/llama-batched-bench`): `llama-batched-bench -npp P -ntg G -npl B
-t THREADS`, default settings, on GGUF files converted once by `DIR/convert_hf_to_gguf.py`
(f32 and bf16) and kept under ~/.cache/tokenmill/gguf. llama.cpp runs in a child process
with the caller's environment (tokenmill's OMP_WAIT_POLICY is not passed on).

Default model: the SmolLM2-135M-shaped random model (benchmarks/make_smollm_shaped_model.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llamacpp import GGUF_TYPES, gguf_file

from tokenmill import LLM, SamplingParams


def tokenmill_rate(llm: LLM, batch: int, prompt_len: int, gen_len: int, seed: int) -> float:
    rng = random.Random(seed)
    vocab = llm.engine.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def llamacpp_rate(
    bench: Path, gguf: Path, batch: int, prompt_len: int, gen_len: int, threads: int
) -> float:
    context = batch * (prompt_len + gen_len)
    command = [str(bench), "-m", str(gguf), "-c", str(context), "-t", str(threads)]
    command += ["-npp", str(prompt_len), "-ntg", str(gen_len), "-npl", str(batch)]
    command += ["--output-format", "jsonl"]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return batch * gen_len / rows[-1]["t"]


def markdown_table(rates: dict[tuple[str, int], list[float]], batches: list[int]) -> str:
    systems = sorted({system for system, _ in rates}, key=lambda s: (s.startswith("llama"), s))
    header = "| B | " + " | ".join(systems) + " | tokenmill best / llama.cpp best |"
    lines = [header, "|---" * (len(systems) + 2) + "|"]
    for batch in batches:
        medians = {s: statistics.median(rates[(s, batch)]) for s in systems}
        ours = max((v for s, v in medians.items() if s.startswith("tokenmill")), default=None)
        theirs = max((v for s, v in medians.items() if s.startswith("llama")), default=None)
        ratio = f"**{ours / theirs:.2f}x**" if ours and theirs else "-"
        cells = " | ".join(f"{medians[s]:.1f}" for s in systems)
        lines.append(f"| {batch} | {cells} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-shaped")
    parser.add_argument("--llamacpp", type=Path, default=None, help="llama.cpp source tree")
    parser.add_argument("--batches", default="1,16,64", help="concurrent requests, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="of float32, bfloat16")
    parser.add_argument("--prompt-len", type=int, default=128, help="random prompt tokens")
    parser.add_argument("--gen-len", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds (median)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp -t")
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    if args.model is None:
        sys.path.insert(0, str(Path(__file__).parent))
        from make_smollm_shaped_model import model_dir

        args.model = model_dir()
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = args.dtypes.split(",")
    engines = {
        f"tokenmill {dtype}": LLM(
            model=str(args.model), dtype=dtype, max_model_len=512, max_num_seqs=max(batches)
        )
        for dtype in dtypes
    }
    ggufs: dict[str, Path] = {}
    bench = None
    if args.llamacpp is not None:
        bench = args.llamacpp / "build" / "bin" / "llama-batched-bench"
        ggufs = {
            f"llama.cpp {GGUF_TYPES[d]}": gguf_file(args.model, args.llamacpp, d) for d in dtypes
        }
    rates: dict[tuple[str, int], list[float]] = {}
    for round_index in range(args.repeats):
        for batch in batches:
            for name, llm in engines.items():
                rate = tokenmill_rate(llm, batch, args.prompt_len, args.gen_len, round_index)
                rates.setdefault((name, batch), []).append(rate)
                print(f"round {round_index} B={batch} {name}: {rate:.1f} tok/s", flush=True)
            for name, gguf in ggufs.items():
                assert bench is not None
                rate = llamacpp_rate(
                    bench, gguf, batch, args.prompt_len, args.gen_len, args.threads
                )
                rates.setdefault((name, batch), []).append(rate)
                print(f"round {round_index} B={batch} {name}: {rate:.1f} tok/s", flush=True)
    table = markdown_table(rates, batches)
    print(table)
    if args.output is not None:
        args.output.write_text(table + "\n")


if __name__ == "__main__":
    main()
