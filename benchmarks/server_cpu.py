"""CPU time per generated token: `tokenmill serve` under `bench serve` vs the offline engine.

    python -m benchmarks.server_cpu [--model PATH] [--concurrency 1,8,32] [--tree DIR ...]

For each source tree (`--tree`, default this one; give two to compare them, run alternately
`--rounds` times): one `tokenmill serve --max-model-len 512 --max-num-seqs C` per concurrency C,
with OMP_NUM_THREADS=1, then `bench serve` with 4C requests (at least 8) of 128 random prompt
ids + 128 tokens, C in flight, each carrying the online table's `logit_bias`
(benchmarks/peers/online.py), after an untimed warm-up. The server's CPU time (user + system of
every process in its group, from /proc) over the timed run, divided by the tokens generated,
is compared with the same requests run offline (`LLM.generate`, same tree, same limits and
parameters, process CPU time). Their difference is what serving costs per token: HTTP,
streaming, detokenizing, asyncio. Prints one line per tree and C (milliseconds per token).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import REPO_ROOT

TICKS = os.sysconf("SC_CLK_TCK")

OFFLINE = """
import json, random, sys, time
from tokenmill import LLM, SamplingParams
model, concurrency, count, bias = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = LLM(model=model, max_model_len=512, max_num_seqs=concurrency)
params = SamplingParams(
    temperature=0.0,
    max_tokens=128,
    ignore_eos=True,
    logit_bias={int(k): v for k, v in json.loads(bias).items()} or None,
)
def prompts(seed):
    rng = random.Random(seed)
    return [[rng.randrange(10, 2000) for _ in range(128)] for _ in range(count)]
llm.generate(prompts(0), params, use_tqdm=False)  # warm-up
start = time.process_time()
outputs = llm.generate(prompts(1), params, use_tqdm=False)
tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
print(json.dumps({"cpu": time.process_time() - start, "tokens": tokens}))
"""


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of the live processes of process group `pgid`."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields from the state on: state ppid pgrp ...
            total += int(fields[11]) + int(fields[12])
    return total / TICKS


def env_for(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}


def online(tree: Path, model: str, concurrency: int, bias: dict, work: Path) -> float:
    """Server CPU milliseconds per generated token under bench serve at `concurrency`."""
    from tokenmill.bench.server_process import ServerProcess

    args = ["--model", model, "--max-model-len", "512", "--max-num-seqs", str(concurrency)]
    server = ServerProcess(args, work / "server.log", env=env_for(tree))
    num_prompts = max(8, 4 * concurrency)
    with server:
        assert server.process is not None
        pgid = server.process.pid

        def bench(count: int, seed: int) -> dict:
            result = work / "result.json"
            command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "bench", "serve"]
            command += ["--base-url", server.base_url, "--tokenizer", model]
            command += ["--dataset-name", "random-ids", "--num-prompts", str(count)]
            command += ["--random-input-len", "128", "--random-output-len", "128"]
            command += ["--max-concurrency", str(concurrency), "--request-rate", "inf"]
            command += ["--seed", str(seed), "--disable-tqdm", "--save-result", str(result)]
            command += ["--extra-body", json.dumps({"logit_bias": bias})]
            subprocess.run(command, env=env_for(tree), check=True, capture_output=True)
            return json.loads(result.read_text())

        bench(concurrency, 7)  # warm-up
        before = group_cpu_seconds(pgid)
        data = bench(num_prompts, 11)
        cpu = group_cpu_seconds(pgid) - before
    return cpu / data["total_output_tokens"] * 1e3


def offline(tree: Path, model: str, concurrency: int, bias: dict) -> float:
    """The offline engine's CPU milliseconds per generated token for the same requests."""
    count = max(8, 4 * concurrency)
    run = subprocess.run(
        [sys.executable, "-c", OFFLINE, model, str(concurrency), str(count), json.dumps(bias)],
        env=env_for(tree),
        check=True,
        capture_output=True,
        text=True,
    )
    data = json.loads(run.stdout.strip().splitlines()[-1])
    return data["cpu"] / data["tokens"] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--tree", action="append", default=None, help="source tree (repeat)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--no-bias", action="store_true", help="requests without logit_bias")
    args = parser.parse_args()
    if args.model is None:
        from tokenmill.bench.random_model import PRESETS

        args.model = str(PRESETS["smollm"].model_dir())
    from tokenmill.bench.llamacpp import whole_character_bias

    bias = {} if args.no_bias else whole_character_bias(Path(args.model))
    trees = [Path(t) for t in (args.tree or [str(REPO_ROOT)])]
    with tempfile.TemporaryDirectory() as work_dir:
        for round_index in range(args.rounds):
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                for tree in trees if round_index % 2 == 0 else trees[::-1]:
                    start = time.monotonic()
                    served = online(tree, args.model, concurrency, bias, Path(work_dir))
                    engine = offline(tree, args.model, concurrency, bias)
                    print(
                        f"round {round_index} {tree} C={concurrency}: server {served:.3f} "
                        f"ms/token, offline {engine:.3f}, serving costs {served - engine:.3f} "
                        f"({time.monotonic() - start:.0f} s)",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
