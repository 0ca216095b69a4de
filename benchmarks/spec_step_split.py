"""Where a speculative step's time goes at batch 1: the target's forward (verification),
the draft's proposal, and the rest (scheduling, sampling, bookkeeping).

    python -m benchmarks.spec_step_split [--methods draft_model,eagle] [--tasks story,sort]
        [--k 4] [--max-tokens 96] [--repeats 3] [--threads 1]

`draft_model_python` among the methods: the draft model with the chain stepped from Python
(TOKENMILL_NATIVE_DRAFT_CHAIN=0), beside `draft_model` (one native call per proposal: the
catch-up and the chain); `draft_model_two_calls`: the catch-up a call of its own before the
native chain; `draft_model_team`: its forwards on the engine's threads, not one; `draft_model@8`:
a method at its own k.

The demo target, one prompt at a time (fixed k, greedy), each configuration beside no
speculation, interleaved; medians over the repeats of each run's totals. The target's forward
is the runner's own clock (`forward_seconds`: forward and logits), the proposal the step's
`propose_seconds`; a step is one `execute_model` (the prefill's included). Each row also gives
the process's CPU time per output token ("cpu/tok"): with `--threads 1` (torch's and the native
pool's threads) it moves far less with other processes' load than wall time does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.spec_decode import generate_greedy, task_prompts
from tokenmill import LLM


def engine(method: str, k: int) -> LLM:
    """`draft_model_python`: the draft model with its chain step by step from Python (the
    native `draft_chain` off), `_two_calls` and `_team` (see the module's docstring), for
    A/B in one run; `METHOD@K`: that method at k = K."""
    method, _, own_k = method.partition("@")
    k = int(own_k) if own_k else k
    python_chain = method == "draft_model_python"
    variant = method.removeprefix("draft_model_") if method.startswith("draft_model_") else ""
    method = "draft_model" if variant else method
    spec = None if method == "off" else {"method": method, "num_speculative_tokens": k}
    if spec is not None:
        spec["adaptive"] = False
    if python_chain:
        os.environ["TOKENMILL_NATIVE_DRAFT_CHAIN"] = "0"
    try:
        llm = LLM(model=None, max_num_seqs=1, speculative_config=spec)
    finally:
        os.environ.pop("TOKENMILL_NATIVE_DRAFT_CHAIN", None)
    proposer: Any = llm.engine.runner.proposer
    if variant == "two_calls":
        proposer.fold_catch_up = False
    if variant == "team":
        proposer.one_thread_rows = 0
    return llm


def timed_run(llm: LLM, prompts: list[str], max_tokens: int) -> dict[str, float]:
    """Seconds (wall, target forward, proposal), steps and tokens of one pass over `prompts`,
    one request at a time."""
    runner: Any = llm.engine.runner
    proposals: list[float] = []
    execute = runner.execute_model

    def counted(scheduler_output: Any) -> Any:
        output = execute(scheduler_output)
        proposals.append(getattr(output, "propose_seconds", 0.0) or 0.0)
        return output

    runner.execute_model = counted
    llm.reset_prefix_cache()
    forward_before = runner.forward_seconds
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = 0
    try:
        for prompt in prompts:
            tokens += len(generate_greedy(llm, [prompt], max_tokens)[0].outputs[0].token_ids)
    finally:
        runner.execute_model = execute
    return {
        "wall": time.perf_counter() - start,
        "cpu": time.process_time() - cpu_start,
        "forward": runner.forward_seconds - forward_before,
        "propose": sum(proposals),
        "steps": len(proposals),
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--methods", default="draft_model,eagle")
    parser.add_argument("--tasks", default="story,sort")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    args = parser.parse_args()
    if args.threads > 0:  # before any engine: the native pool takes torch's count once
        torch.set_num_threads(args.threads)
    engines = {m: engine(m, args.k) for m in ["off", *args.methods.split(",")]}
    for task in args.tasks.split(","):
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
        for _ in range(args.repeats):
            for name, llm in engines.items():
                runs[name].append(timed_run(llm, task_prompts(llm, task, 8), args.max_tokens))
        print(f"## {task}: per step, ms (median of {args.repeats})")
        base = None
        for name, results in runs.items():
            med = {key: statistics.median(r[key] for r in results) for key in results[0]}
            rate = med["tokens"] / med["wall"]
            base = base or rate
            ms = {key: 1e3 * med[key] / med["steps"] for key in ("wall", "forward", "propose")}
            rest = ms["wall"] - ms["forward"] - ms["propose"]
            print(
                f"  {name:<12} {rate:7.0f} tok/s {rate / base:4.2f}x  {med['steps']:.0f} steps"
                f" {med['tokens'] / med['steps']:.2f} tok/step  wall {ms['wall']:.3f} ="
                f" target {ms['forward']:.3f} + propose {ms['propose']:.3f} + rest {rest:.3f}"
                f"  cpu/tok {1e3 * med['cpu'] / med['tokens']:.3f} ms"
            )


if __name__ == "__main__":
    main()
