"""What a long prompt costs cut into small chunks beside decoding streams, against the
no-target run's big chunks, and the TTFT bound that sets for an ITL target (issue 19).

    python benchmarks/chunked_prefill_cost.py [--chunks 16 32 64 128] [--repeats 3]

Under a target of F times the steady step, a step's prompt chunk may add at most (F - 1)
steady steps to the decodes' own step. A perfect scheduler (exact costs, every step filled to
the target, the decodes' step not growing) then needs, for the long prompt's first token,

    TTFT = steps * steady + (sum over its chunks of the time each adds to a decode step)

and at F = 2 that is about twice the chunks' added time: the goal "TTFT within 2x of no
target" holds only if cutting the prompt into chunks that fit costs no more than the
no-target run's two 2,048-token steps. Both sides are measured here in one engine,
interleaved, with the scenario's shapes (itl_under_prefill.py: SmolLM2-135M-shaped, fp32, 32
streams decoding at context ~80, a 4,000-token prompt):

- the decode step alone (32 rows), and no target: the two steps of 2,048 and 1,952 prompt
  tokens beside the decodes, whole;
- what a chunk of n tokens after c cached ones adds to the decode step, for each `--chunks`
  n at each `--contexts` c, fitted per c as a fixed cost per chunk plus a cost per token;
- the decode step at longer stream contexts (each step of the admission adds a position to
  every stream, and attention reads them all);
- the perfect scheduler's steps under each target, from those lines (interpolated), with the
  decode step growing as the streams do, and held at its steady cost.

Synthetic steps (`worker/calibration.py`): the runner computes them as it would real ones.
"""

from __future__ import annotations

import argparse
import statistics

from itl_under_prefill import smollm2_shaped_model

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.worker.calibration import SyntheticRow, time_synthetic_step
from tokenmill.worker.model_runner import ModelRunner

STREAMS = 32
STREAM_CONTEXT = 80
BIG_CHUNK = 2048


class StepTimer:
    """Median times of synthetic steps, each warmed up once (unique request ids per run)."""

    def __init__(self, runner: ModelRunner, repeats: int) -> None:
        self.runner = runner
        self.repeats = repeats
        self.count = 0

    def once(self, rows: list[SyntheticRow]) -> float:
        self.count += 1
        return time_synthetic_step(self.runner, rows, f"bench-{self.count}")

    def compare(self, base: list[SyntheticRow], other: list[SyntheticRow]) -> tuple[float, float]:
        """(median of base's step in seconds, median of (other's step - base's) in units of
        base's step measured beside it): the machine's speed drifts by tens of percent from
        one minute to the next, and a ratio of neighbouring steps carries little of that."""
        self.once(other)
        alone, more = [], []
        for _ in range(self.repeats):
            a = self.once(base)
            more.append((self.once(other) - a) / a)
            alone.append(a)
        return statistics.median(alone), statistics.median(more)


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of added time against chunk length at one context."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def interpolate(points: dict[int, float], x: float) -> float:
    """Linear between the two nearest sampled points, flat beyond them."""
    xs = sorted(points)
    below = max((p for p in xs if p <= x), default=xs[0])
    above = min((p for p in xs if p >= x), default=xs[-1])
    share = 0.0 if above == below else (x - below) / (above - below)
    return points[below] + share * (points[above] - points[below])


def best_schedule(
    lines: dict[int, tuple[float, float]],
    decode_growth: dict[int, float],
    prompt: int,
    factor: float,
) -> tuple[int, float]:
    """A perfect scheduler's steps under a target of `factor` steady steps: each step the
    longest chunk whose added time fits beside the decodes' step (which grows as the streams'
    contexts do, one position a step; `decode_growth`), at least one token. Everything in
    steady steps; returns (steps, TTFT)."""
    intercepts = {c: line[0] for c, line in lines.items()}
    slopes = {c: line[1] for c, line in lines.items()}
    cached, steps, ttft = 0, 0, 0.0
    while cached < prompt:
        decode = interpolate(decode_growth, STREAM_CONTEXT + steps)
        intercept, slope = interpolate(intercepts, cached), interpolate(slopes, cached)
        fitting = int((factor - decode - intercept) / max(slope, 1e-9))
        num = max(1, min(prompt - cached, fitting))
        ttft += decode + intercept + slope * num
        cached += num
        steps += 1
    return steps, ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt", type=int, default=4000)
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[0, 1000, 2000, 3000, 3900])
    parser.add_argument("--stream-contexts", type=int, nargs="+", default=[150, 250, 400])
    parser.add_argument("--factors", type=float, nargs="+", default=[1.5, 2.0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = args.model or str(smollm2_shaped_model())
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", max_model_len=8192))
    timer = StepTimer(engine.runner, args.repeats)
    decodes = [SyntheticRow(STREAM_CONTEXT, 1)] * STREAMS

    # Everything in units of the decode step measured beside it (StepTimer.compare).
    no_target, steady_samples = 0.0, []
    for cached, num in [(0, BIG_CHUNK), (BIG_CHUNK, args.prompt - BIG_CHUNK)]:
        steady, added = timer.compare(decodes, [*decodes, SyntheticRow(cached, num)])
        steady_samples.append(steady)
        no_target += 1 + added
    decode_growth = {STREAM_CONTEXT: 1.0}
    for context in args.stream_contexts:
        steady, more = timer.compare(decodes, [SyntheticRow(context, 1)] * STREAMS)
        steady_samples.append(steady)
        decode_growth[context] = 1 + more

    print("| cached before the chunk | " + " | ".join(f"{n} tokens add" for n in args.chunks)
          + " | fitted: per chunk + per token |\n|---" + "|---" * (len(args.chunks) + 1) + "|",
          flush=True)  # fmt: skip
    lines = {}
    for cached in args.contexts:
        points = []
        for num in args.chunks:
            steady, added = timer.compare(decodes, [*decodes, SyntheticRow(cached, num)])
            steady_samples.append(steady)
            points.append((num, added))
        lines[cached] = fit_line(points)
        cells = " | ".join(f"{added:.2f}" for _, added in points)
        intercept, slope = lines[cached]
        print(f"| {cached} | {cells} | {intercept:.2f} + {1000 * slope:.2f} / 1000 tokens |",
              flush=True)  # fmt: skip
    growth = ", ".join(f"{c}: {r:.2f}" for c, r in sorted(decode_growth.items()))
    print(
        f"\nIn decode steps ({STREAMS} rows at context {STREAM_CONTEXT}, median "
        f"{1000 * statistics.median(steady_samples):.0f} ms). The decode step at the streams' "
        f"contexts: {growth}.\nNo target ({BIG_CHUNK} + {args.prompt - BIG_CHUNK} prompt "
        f"tokens in two steps beside the decodes): {no_target:.1f} decode steps.\n"
    )
    no_target_throughput = (args.prompt + 2 * STREAMS) / no_target
    for factor in args.factors:
        for label, growth_used in (("streams growing", decode_growth), ("held", {0: 1.0})):
            steps, ttft = best_schedule(lines, growth_used, args.prompt, factor)
            throughput = (args.prompt + STREAMS * steps) / ttft
            print(
                f"target {factor}x steady, decode step {label}: a perfect scheduler needs "
                f"{steps} steps, TTFT {ttft / no_target:.2f}x no target, throughput while "
                f"admitted {throughput / no_target_throughput:.2f}x"
            )


if __name__ == "__main__":
    main()
