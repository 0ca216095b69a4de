"""Where a decode step's time goes: torch.profiler over steady-state decode steps.

    python -m benchmarks.steps profile [--model PATH] [--dtype float32] [--batch 1] [--steps 20]

Starts `--batch` requests of 128 random prompt tokens, runs them into steady decoding, then
profiles `--steps` engine steps and prints the per-step wall time, the process's CPU time per
step (with OMP_NUM_THREADS=1, the figure that a shared machine's load disturbs least), the
time inside the model's forward, and the operators by self CPU time (per step), with the
number of op calls.
Default model: the SmolLM2-135M-shaped random model of `tokenmill bench make-model --preset smollm`.
"""

from __future__ import annotations

import argparse
import random
import time

from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", type=int, default=25, help="operators to list")
    parser.add_argument("--engine-args", default="{}", help="JSON of extra LLM(...) arguments")
    args = parser.parse_args()
    if args.model is None:
        from tokenmill.bench.random_model import PRESETS

        args.model = str(PRESETS["smollm"].model_dir())
    import json

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=512, **json.loads(args.engine_args))
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    for i in range(args.batch):
        prompt = [rng.randrange(10, 2000) for _ in range(128)]
        engine.add_request(str(i), prompt, params)
    for _ in range(10):  # prefill and warm up
        engine.step()
    forward_before = engine.get_stats().forward_seconds
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - start) / args.steps
    cpu = (time.process_time() - cpu_start) / args.steps
    forward = (engine.get_stats().forward_seconds - forward_before) / args.steps
    print(
        f"step {wall * 1e3:.2f} ms (CPU {cpu * 1e3:.2f} ms), forward+logits "
        f"{forward * 1e3:.2f} ms (batch {args.batch})"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    events = prof.key_averages()
    total_calls = sum(e.count for e in events if not e.key.startswith("ProfilerStep"))
    print(f"op calls per step: {total_calls / args.steps:.0f}")
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.rows]
    print(f"{'op':<45} {'self ms/step':>12} {'calls/step':>10}")
    for e in rows:
        print(
            f"{e.key[:45]:<45} {e.self_cpu_time_total / 1e3 / args.steps:>12.3f} "
            f"{e.count / args.steps:>10.0f}"
        )
    engine.abort_request([str(i) for i in range(args.batch)])


if __name__ == "__main__":
    main()
