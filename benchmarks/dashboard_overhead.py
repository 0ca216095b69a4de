"""What the dashboard costs the engine at batch 64 (issue 18: it must not slow a step by 1 %).

    python -m benchmarks.dashboard_overhead [--model PATH] [--batch 64] [--repeats 8]

Two measurements, in one run:

1. Side by side: the step loop of a server (step, then the metrics' observations, as the
   AsyncEngine does) on a batch of 64 decoding requests, with the dashboard's statistics off
   (rings that drop their records) and on, with a reader thread doing what one open page
   costs: `DashboardFeed.update()` and its JSON, 4 times a second. Interleaved, median of
   the per-pair ratios of mean step time.
2. The two costs that add up to the overhead, each measured so that a busy machine disturbs it
   little: the CPU time of one page's update (in the reader thread, under that load), as a
   share of a second; and what the step loop adds per step (its record and the ITL
   observations), timed alone, as a share of a step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry

from tokenmill.config import EngineConfig
from tokenmill.core.feedback.records import StepRecord, new_step_ring
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.dashboard.feed import UPDATES_PER_SECOND, DashboardFeed
from tokenmill.entrypoints.default_model import with_default_models
from tokenmill.metrics.prometheus import EngineMetrics
from tokenmill.metrics.recent import RecentLatencies
from tokenmill.sampling_params import SamplingParams


class NullRing:
    """A ring that keeps nothing: the dashboard's statistics switched off."""

    num_appended = 0

    def append(self, record: Any) -> None:
        pass

    def since(self, seq: int) -> tuple[list[Any], int]:
        return [], 0


def set_dashboard(engine: LLMEngine, metrics: EngineMetrics, on: bool) -> None:
    if on:
        engine.step_records = new_step_ring()
        metrics.recent = RecentLatencies()
    else:
        engine.step_records = NullRing()  # type: ignore[assignment]
        metrics.recent = SimpleNamespace(ttft=NullRing(), itl=NullRing(), finished=NullRing())  # type: ignore[assignment]


def run_batch(
    engine: LLMEngine, metrics: EngineMetrics, server: AsyncEngine, batch: int, tokens: int
) -> tuple[float, float]:
    """Mean seconds per step of one batch, from admission to the last token: wall time, and
    the CPU time of this (the engine's) thread, which other processes on a shared machine
    disturb far less."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    stamp = time.time()
    for i in range(batch):
        engine.add_request(f"r{stamp}-{i}", f"Reverse this list: item{i} b c d", params)
    steps_before, seconds_before = engine.num_steps, engine.step_seconds
    start, start_cpu = time.perf_counter(), time.thread_time()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        server.last_stats = engine.get_stats()  # what AsyncEngine._observe does per step
        metrics.record_outputs(outputs)
        metrics.record_stats(server.last_stats)
    wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    num_steps = engine.num_steps - steps_before
    assert engine.step_seconds - seconds_before <= wall
    return wall / num_steps, cpu / num_steps


def reader(feed: DashboardFeed, stop: threading.Event, costs: list[float]) -> None:
    """One open page: an update and its JSON every quarter second; `costs` gets each one's
    thread CPU time (wall time would count the engine thread holding the GIL)."""
    json.dumps(feed.update())  # the first update carries the history: not the steady cost
    while not stop.wait(1 / UPDATES_PER_SECOND):
        start = time.thread_time()
        json.dumps(feed.update(), separators=(",", ":"))
        costs.append(time.thread_time() - start)


def side_by_side(args: argparse.Namespace) -> None:
    config = EngineConfig(model=args.model, max_num_seqs=args.batch)
    engine = LLMEngine(with_default_models(config))
    metrics = EngineMetrics(CollectorRegistry(), "bench")
    # Not started: this thread steps the engine as the server's engine thread would.
    server = AsyncEngine(engine, metrics, log_stats_interval=None)
    run_batch(engine, metrics, server, args.batch, 8)  # warm up
    results: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    update_costs: list[float] = []
    for repeat in range(args.repeats):
        order = (False, True) if repeat % 2 == 0 else (True, False)
        for on in order:
            set_dashboard(engine, metrics, on)
            stop = threading.Event()
            thread = None
            if on:
                feed = DashboardFeed(server, "bench", {})
                thread = threading.Thread(target=reader, args=(feed, stop, update_costs))
                thread.start()
            results[on].append(run_batch(engine, metrics, server, args.batch, args.tokens))
            stop.set()
            if thread is not None:
                thread.join()
        (off_wall, off_cpu), (on_wall, on_cpu) = results[False][-1], results[True][-1]
        print(
            f"repeat {repeat}: step wall {1000 * off_wall:.2f} ms off, {1000 * on_wall:.2f} ms "
            f"on; engine-thread CPU {1000 * off_cpu:.2f} ms off, {1000 * on_cpu:.2f} ms on",
            flush=True,
        )
    print(f"\nbatch {args.batch}, {args.tokens} tokens each, {args.repeats} interleaved pairs:")
    for index, what in enumerate(("step wall time", "engine-thread CPU per step")):
        off = [r[index] for r in results[False]]
        ratios = [on[index] / off[index] for off, on in zip(results[False], results[True])]
        print(
            f"  {what}: median {1000 * statistics.median(off):.2f} ms off, "
            f"{1000 * statistics.median(r[index] for r in results[True]):.2f} ms on; "
            f"median ratio on/off {statistics.median(ratios):.4f} "
            f"(min {min(ratios):.4f}, max {max(ratios):.4f})"
        )
    update = statistics.median(update_costs)
    print(
        f"one page's update under this load (median of {len(update_costs)}): "
        f"{1e6 * update:.0f} us CPU, x{UPDATES_PER_SECOND}/s = "
        f"{100 * update * UPDATES_PER_SECOND:.3f} % of a second"
    )
    record_cost(statistics.median(r[0] for r in results[False]), args.batch)


def record_cost(step_seconds: float, batch: int) -> None:
    """What the step loop itself adds per step, timed alone: the step record, and one ITL
    observation per decoding request (TTFT and finished-request records are rarer)."""
    steps, itl = new_step_ring(), RecentLatencies().itl
    n = 20_000
    start = time.perf_counter()
    for _ in range(n):
        steps.append(StepRecord(time.time(), 0.01, 0, batch, batch, 0, 0))
        for _ in range(batch):
            itl.append((1.0, 0.01))
    per_step = (time.perf_counter() - start) / n
    print(
        f"engine thread, per step at batch {batch}: {1e6 * per_step:.1f} us "
        f"= {100 * per_step / step_seconds:.3f} % of the median {1000 * step_seconds:.2f} ms step"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the built-in demo model")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=8)
    side_by_side(parser.parse_args())


if __name__ == "__main__":
    main()
