"""CPU time of a decode step outside the model's forward, by phase, at several batch sizes.

    OMP_NUM_THREADS=1 python -m benchmarks.steps outside-forward [--model PATH] [--batches 1,16,64]
        [--steps 40] [--json OUT]

One engine (`LLM(model, max_model_len=512)`, the default dtype), then for each batch size B:
B requests of 128 random prompt ids (greedy, ignore_eos, final-only outputs as `LLM.generate`
asks for) run into steady decoding, and
`--steps` engine steps are timed with the main thread's CPU time (`time.thread_time`), split
by wrapping the step's parts: scheduling, input preparation, the forward + logits, sampling,
applying the outputs (stop checks, detokenizing), building the `RequestOutput`s, and the rest
(the step loop, the observer). With OMP_NUM_THREADS=1 every kernel runs on the main thread,
so the split is the whole step's CPU time and load on the machine disturbs it least.
Prints one line per batch (milliseconds of CPU per step) and, with `--json`, writes them.
Default model: the SmolLM2-135M-shaped random model (`tokenmill bench make-model --preset smollm`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import RequestOutputKind

PHASES = ("schedule", "prepare", "forward", "sample", "apply", "outputs")


class PhaseClock:
    """Thread CPU seconds spent inside wrapped callables, by phase name."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        inner: Callable = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.thread_time() - start

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)


def measure(llm: LLM, clock: PhaseClock, batch: int, steps: int, rounds: int) -> dict:
    """Median per-step CPU milliseconds by phase over `rounds` runs of `steps` steps."""
    engine = llm.engine
    rng = random.Random(batch)
    params = SamplingParams(temperature=0.0, max_tokens=10 + steps * rounds + 5, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for req_id in ids:
        prompt = [rng.randrange(10, 2000) for _ in range(128)]
        engine.add_request(req_id, prompt, params, output_kind=RequestOutputKind.FINAL_ONLY)
    for _ in range(10):  # prefill and warm up
        engine.step()
    samples: list[dict] = []
    for _ in range(rounds):
        clock.reset()
        start = time.thread_time()
        for _ in range(steps):
            engine.step()
        total = (time.thread_time() - start) / steps
        phase = {k: v / steps for k, v in clock.seconds.items()}
        outside = total - phase["forward"]
        samples.append({"step": total, "outside": outside, **phase})
    engine.abort_request(ids)
    return {key: statistics.median(s[key] for s in samples) * 1e3 for key in samples[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.model is None:
        from tokenmill.bench.random_model import PRESETS

        args.model = str(PRESETS["smollm"].model_dir())
    llm = LLM(model=args.model, max_model_len=512)
    clock = PhaseClock()
    for phase, owner, name in llm.engine.step_phases():
        clock.wrap(owner, name, phase)
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        row = measure(llm, clock, batch, args.steps, args.rounds)
        row["other"] = row["outside"] - sum(row[p] for p in PHASES if p != "forward")
        results[batch] = row
        parts = " ".join(f"{k} {row[k]:.3f}" for k in (*PHASES, "other"))
        print(
            f"B={batch}: step {row['step']:.2f} ms CPU, outside the forward "
            f"{row['outside']:.3f} ms ({row['outside'] / row['step']:.1%}) | {parts}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
