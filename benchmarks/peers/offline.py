"""vs_peers.py's offline runs: B requests at once, each engine in fresh processes per round.

tokenmill and vLLM run in worker.py (under their own Pythons); llama.cpp as
`llama-batched-bench` (llamacpp.py), which times prefill and decode apart itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.engines import Engine, engine_env
from benchmarks.peers.worker import RESULT
from tokenmill.bench.llamacpp import BatchedBenchRun, batched_bench

WORKER = Path(__file__).resolve().parent / "worker.py"


@dataclass
class OfflineResult:
    """One engine in one round."""

    rates: dict[int, float]  # batch size -> output tok/s, prefill included
    decode_steps_s: float | None = None  # at B = 1, prefill excluded
    float_bytes: int = 4  # bytes per element of its float weights (not llama.cpp's: GGUF)


def run_worker(command: list[str], env: dict[str, str], timeout: float) -> dict:
    """Run a worker process to its RESULT line (its stderr's tail in the error otherwise);
    whatever it started is killed with its process group when it ends, however it ends."""
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"no result within {timeout:.0f} s") from None
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT)]
    if process.returncode != 0 or not lines:
        raise RuntimeError(f"exit code {process.returncode}:\n{stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT) :])


def offline_run(engine: Engine, args: argparse.Namespace, seed: int) -> OfflineResult:
    """`engine` at every batch size of `args.batches`, in processes of its own."""
    batches = [int(b) for b in args.batches.split(",")]
    if engine.runner == "llamacpp":
        runs = {b: llama_bench(engine, args, b, args.prompt_len, args.gen_len) for b in batches}
        decode = runs[1].decode_steps_s if 1 in runs else None
        return OfflineResult({b: r.output_tok_s for b, r in runs.items()}, decode)
    command = worker_command(engine, args, seed)
    data = run_worker(command, engine_env(engine), args.timeout)
    rates = {int(b): rate for b, rate in data["rates"].items()}
    return OfflineResult(rates, data["decode_steps_s"], data["float_bytes"])


@dataclass(frozen=True)
class Resident:
    """Memory after load: the process's, and of it the weights' (None where not separable)."""

    process_bytes: int
    weight_bytes: int | None


def resident_after_load(engine: Engine, args: argparse.Namespace) -> Resident | None:
    """tokenmill: its process's growth over its load (with a KV cache of KV_PROBE_BLOCKS), and
    the bytes of the weight tensors the loaded model holds (`tokenmill.models.weight_bytes`);
    llama.cpp: its peak over an 8 + 8-token run (the weights are the file, mmapped, plus a KV
    cache of 16 tokens and its buffers); None for vLLM (its model lives in an engine-core
    process with its own interpreter and a KV space of whole GiB: no number isolates its
    weights)."""
    if engine.runner == "vllm":
        return None
    if engine.runner == "llamacpp":
        return Resident(llama_bench(engine, args, 1, 8, 8).peak_rss_bytes, None)
    command = [*worker_command(engine, args, seed=0), "--memory"]
    data = run_worker(command, engine_env(engine), args.timeout)
    return Resident(data["rss_load_bytes"], data["weight_bytes"])


def llama_bench(
    engine: Engine, args: argparse.Namespace, batch: int, prompt_len: int, gen_len: int
) -> BatchedBenchRun:
    bin_dir = args.llamacpp / "build" / "bin"
    return batched_bench(
        bin_dir, engine.weights, batch, prompt_len, gen_len, args.threads, engine.flags
    )


def worker_command(engine: Engine, args: argparse.Namespace, seed: int) -> list[str]:
    python = str(args.vllm_python) if engine.runner == "vllm" else sys.executable
    command = [python, str(WORKER), "--runner", engine.runner]
    command += ["--weights", str(engine.weights), "--dtype", engine.dtype]
    command += ["--batches", args.batches, "--seed", str(seed)]
    command += ["--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len)]
    command += ["--max-model-len", str(max(512, args.prompt_len + args.gen_len))]
    if engine.tokenizer is not None:
        command += ["--tokenizer", str(engine.tokenizer)]
    return command
