"""Inter-token latency of decoding streams while a long prompt arrives (issue 19), offline.

    python benchmarks/itl_under_prefill.py [--model PATH] [--repeats 1]

32 streams decode (64-token prompts); once every stream decodes and 16 steady steps are
timed, one 4,000-token prompt arrives. Every engine step emits one token per stream, so the
step time is the inter-token latency every stream sees. Per configuration:

- steady: the median step before the long prompt arrives;
- p99 / worst step while it is admitted (from its arrival to its first token), and p99 over
  steady;
- TTFT of the long prompt;
- throughput: tokens computed (prompt + generated) from its arrival to its first token, over
  that time (a target stretches the window, and the streams decode through it).

Configurations: the issue's fixed budgets (2048, 512, 256 chunked; 8192 unchunked), then
`--itl-target-ms` at 1.5x and 2x the steady step measured in the first configuration. With no
model, a random-weight model shaped like SmolLM2-135M (context 8192) is built once.
Greedy, fp32. Run several repeats on a shared machine (configurations interleaved; medians).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from make_bench_model import cached_random_model
from make_smollm_shaped_model import SHAPE as SMOLLM2_SHAPE

from tokenmill import SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine

MODEL_NAME = "bench-smollm2-135m-shaped-8k-v1"  # bump the version when changing the recipe
FIXED_BUDGETS: dict[str, dict[str, Any]] = {
    "2048 chunked": {"max_num_batched_tokens": 2048},
    "512 chunked": {"max_num_batched_tokens": 512},
    "256 chunked": {"max_num_batched_tokens": 256},
    "8192 unchunked": {"max_num_batched_tokens": 8192, "enable_chunked_prefill": False},
}
TARGET_FACTORS = (1.5, 2.0)


def smollm2_shaped_model() -> Path:
    """SmolLM2-135M's shape (make_smollm_shaped_model.py) with an 8192-token context, built
    once into the cache directory (the benchmark feeds token ids)."""
    return cached_random_model(MODEL_NAME, **{**SMOLLM2_SHAPE, "max_position_embeddings": 8192})


@dataclass
class Run:
    steady: float  # seconds: median step before the long prompt arrives
    admission_steps: list[float]  # step times from its arrival to its first token
    ttft: float
    throughput: float  # tokens computed per second after its arrival
    steps_over_target: int | None

    @property
    def p99(self) -> float:
        return percentile(self.admission_steps, 0.99)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_once(model: Path, engine_kwargs: dict[str, Any], args: argparse.Namespace) -> Run:
    engine = LLMEngine(
        EngineConfig(
            model=str(model), dtype="float32", max_model_len=args.max_model_len, **engine_kwargs
        )
    )
    rng = random.Random(0)
    vocab = engine.vocab_size
    for i in range(args.streams):
        prompt = [rng.randrange(3, vocab) for _ in range(args.stream_prompt)]
        # Decoding through the whole run (the default max_tokens, 16, ended the streams during
        # the steady steps: the long prompt then arrived into an idle engine).
        params = SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=args.max_model_len - args.stream_prompt
        )
        engine.add_request(f"stream-{i}", prompt, params)
    decoding: set[str] = set()
    while len(decoding) < args.streams:  # until every stream decodes (under a target the
        decoding.update(o.request_id for o in engine.step())  # prompts take several steps)
    steady = [timed_step(engine)[0] for _ in range(args.steady_steps)]

    long_prompt = [rng.randrange(3, vocab) for _ in range(args.long_prompt)]
    before = engine.get_stats()
    arrival = time.perf_counter()
    engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=1))
    admission, ttft = [], None
    while ttft is None:
        seconds, outputs = timed_step(engine)
        admission.append(seconds)
        if any(o.request_id == "long" for o in outputs):
            ttft = time.perf_counter() - arrival
    streams = [r for r in engine.running_request_ids() if r.startswith("stream-")]
    assert len(streams) == args.streams, "a stream stopped decoding during the run"
    after = engine.get_stats()
    tokens = (after.num_prompt_tokens - before.num_prompt_tokens) + (
        after.num_generation_tokens - before.num_generation_tokens
    )
    itl = after.scheduler.itl_target
    return Run(
        steady=statistics.median(steady),
        admission_steps=admission,
        ttft=ttft,
        throughput=tokens / ttft,
        steps_over_target=None if itl is None else itl.num_steps_over_target,
    )


def timed_step(engine: LLMEngine) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = engine.step()
    return time.perf_counter() - start, outputs


def report(label: str, runs: list[Run]) -> str:
    def median(values) -> float:
        return statistics.median(list(values))

    steady = median(r.steady for r in runs)
    p99 = median(r.p99 for r in runs)
    worst = median(max(r.admission_steps) for r in runs)
    over = [r.steps_over_target for r in runs if r.steps_over_target is not None]
    steps = median(len(r.admission_steps) for r in runs)
    return (
        f"| {label} | {1000 * steady:.0f} ms | {1000 * p99:,.0f} ms | {1000 * worst:,.0f} ms "
        f"| {p99 / steady:.1f}x | {median(r.ttft for r in runs):.1f} s | {steps:.0f} "
        f"| {median(r.throughput for r in runs):,.0f} tok/s "
        f"| {median(over) if over else '-'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--stream-prompt", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=4000)
    parser.add_argument("--steady-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=8192)
    args = parser.parse_args()
    model = args.model or smollm2_shaped_model()

    configs = dict(FIXED_BUDGETS)
    runs: dict[str, list[Run]] = {label: [] for label in configs}
    baseline = run_once(model, configs["2048 chunked"], args)  # the targets follow its steady
    for factor in TARGET_FACTORS:
        target_ms = factor * 1000 * baseline.steady
        configs[f"itl target {factor}x = {target_ms:.0f} ms"] = {"itl_target_ms": target_ms}
        runs[list(configs)[-1]] = []
    runs["2048 chunked"].append(baseline)
    print(f"repeat 0: {report('2048 chunked', [baseline])}", flush=True)
    for repeat in range(args.repeats):
        for label, kwargs in configs.items():
            if repeat == 0 and label == "2048 chunked":
                continue
            runs[label].append(run_once(model, kwargs, args))
            print(f"repeat {repeat}: {report(label, runs[label][-1:])}", flush=True)
    print(
        "\n| configuration | steady step | p99 step while admitted | worst step | p99 / steady "
        "| TTFT long prompt | steps to its first token | throughput while admitted "
        "| steps over target |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, label_runs in runs.items():
        print(report(label, label_runs))


if __name__ == "__main__":
    main()
