"""Routing simulator: round-robin vs least-loaded vs prefix-aware vs KV-events-driven routing
over many replicas.

    python -m benchmarks.route_sim --plot docs/images/route_sim.png

A synthetic multi-tenant workload (tenants with Zipf-distributed traffic, each with its own
1-4k-token system prompt, a unique user part, Poisson arrivals) is routed over N replicas
by the router's own policies (tokenmill/entrypoints/router/balancing/policies.py, the same objects
`tokenmill router` uses). Each replica is modelled as:

- a prefix cache of its KV capacity in tokens, holding whole system prompts, least recently
  used evicted first (user parts are unique, so never hit);
- one work-conserving FCFS server: a request's prefill costs what tokenmill's step cost
  model (tokenmill/core/feedback/cost_model.py) says for its uncached tokens after its cached ones,
  `fixed + per_prefill * n + per_context * (n * c + n (n + 1) / 2)`, and its decode adds
  `per_decode` per output token of the replica's time. The coefficients default to a fit
  on this machine (`--fit-model`, see docs/scale_out.md).

TTFT = queueing + prefill. The policies see each replica's requests in flight (what the
router counts itself). Reported per policy: prefix-hit rate (prompt tokens served from
cache), TTFT p50/p99, and load imbalance: at each arrival, the busiest replica's requests in
flight over the mean (p50 and p99 of that ratio), and the busiest replica's total work over
the mean.
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import statistics
import sys
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.core.feedback.cost_model import chunk_context
from tokenmill.entrypoints.router.balancing.policies import (
    DEFAULT_BALANCE_ABS_THRESHOLD,
    ReplicaLoad,
    make_policy,
)

# Step cost coefficients (seconds): fixed, per decode token, per prefill token, per context
# position. Fitted by tokenmill's start-up calibration (worker/calibration.py) on the
# SmolLM2-135M-shaped random model (`tokenmill bench make-model --preset smollm`) on this machine,
# 2 cores loaded by parallel work (so slow in absolute terms; the simulation's results scale
# with them: what matters is their ratios): `route_sim.py --fit-model DIR`.
DEFAULT_COEFFICIENTS = (0.441, 0.0593, 0.0513, 0.0000587)
# Seconds from a cache change to the router reading its KV event: a step (the engine
# publishes a step's events after it) plus delivery, at the coefficients' speed.
DEFAULT_EVENT_DELAY = 0.5


@dataclass(frozen=True)
class Workload:
    num_tenants: int = 200
    zipf_s: float = 1.0
    system_tokens: tuple[int, int] = (1024, 4096)
    user_tokens: tuple[int, int] = (32, 512)
    output_tokens: tuple[int, int] = (32, 256)
    num_requests: int = 20000
    seed: int = 0


@dataclass
class Request:
    arrival: float
    tenant: int
    system: int
    user: int
    output: int


@dataclass
class Replica:
    name: str
    capacity: int  # KV tokens
    cache: OrderedDict[int, int] = field(default_factory=OrderedDict)  # tenant -> tokens
    cached_tokens: int = 0
    free_at: float = 0.0
    finishes: deque[float] = field(default_factory=deque)
    work: float = 0.0
    # What its KV event stream says, in order: (time, stored?, tenant), BlockStored of a
    # tenant's system prompt when it is cached, BlockRemoved when it is evicted.
    events: deque[tuple[float, bool, int]] = field(default_factory=deque)

    def in_flight(self, now: float) -> int:
        while self.finishes and self.finishes[0] <= now:
            self.finishes.popleft()
        return len(self.finishes)

    def lookup_and_insert(self, tenant: int, tokens: int, now: float = 0.0) -> int:
        """Cached tokens of this tenant's system prompt; then it is cached (LRU), each change
        published as an event at `now`."""
        hit = self.cache.get(tenant, 0)
        if tenant in self.cache:
            self.cache.move_to_end(tenant)
        else:
            self.cache[tenant] = tokens
            self.cached_tokens += tokens
            self.events.append((now, True, tenant))
            while self.cached_tokens > self.capacity and len(self.cache) > 1:
                gone, evicted = self.cache.popitem(last=False)
                self.cached_tokens -= evicted
                self.events.append((now, False, gone))
        return hit


def make_requests(workload: Workload, rate: float) -> tuple[list[Request], list[int]]:
    rng = random.Random(workload.seed)
    systems = [rng.randint(*workload.system_tokens) for _ in range(workload.num_tenants)]
    weights = [1 / (k + 1) ** workload.zipf_s for k in range(workload.num_tenants)]
    cumulative = [sum(weights[: i + 1]) for i in range(len(weights))]
    t = 0.0
    requests = []
    for _ in range(workload.num_requests):
        t += rng.expovariate(rate)
        tenant = bisect.bisect_left(cumulative, rng.random() * cumulative[-1])
        requests.append(
            Request(
                t,
                tenant,
                systems[tenant],
                rng.randint(*workload.user_tokens),
                rng.randint(*workload.output_tokens),
            )
        )
    return requests, systems


def prefill_seconds(coefficients: tuple[float, ...], new: int, cached: int) -> float:
    fixed, _, per_prefill, per_context = coefficients
    return fixed + per_prefill * new + per_context * chunk_context(new, cached)


def service_seconds(coefficients: tuple[float, ...], request: Request, cached: int) -> float:
    prompt = request.system + request.user
    return prefill_seconds(coefficients, prompt - cached, cached) + coefficients[1] * request.output


class EventsDriven:
    """A router fed the replicas' KV cache events (`--kv-events-config`, as llm-d's precise
    prefix scorer is): its index of which replica holds which tenant's system prompt is built
    from their event streams alone, each event read `delay` seconds after the change it
    reports (published after the step, then delivered), never from the caches themselves. It
    sends a request to the least-loaded holder (spilling past the same balance thresholds as
    `prefix-aware`); when none holds it, `prefix-aware` decides (its rendezvous owner, so a
    tenant's first copies land where its next requests look)."""

    def __init__(self, replicas: list[Replica], abs_threshold: float, delay: float) -> None:
        self.replicas = replicas
        self.delay = delay
        self.held: dict[str, set[int]] = {r.name: set() for r in replicas}
        self.balance = make_policy("prefix-aware", balance_abs_threshold=abs_threshold)

    def read_events(self, now: float) -> None:
        """Apply every event delivered by `now` (each replica's stream is in time order)."""
        for replica in self.replicas:
            held = self.held[replica.name]
            while replica.events and replica.events[0][0] + self.delay <= now:
                _, stored, tenant = replica.events.popleft()
                (held.add if stored else held.discard)(tenant)

    def choose_replica(self, loads: list[ReplicaLoad], tenant: int, key: bytes) -> str:
        lightest = min(loads, key=lambda r: r.load)
        holders = [load for load in loads if tenant in self.held[load.name]]
        if not holders:
            return self.balance.choose(loads, key).replica
        best = min(holders, key=lambda r: r.load)
        return lightest.name if self.balance.overloaded(best.load, lightest.load) else best.name


def simulate(
    policy_name: str,
    requests: list[Request],
    num_replicas: int,
    capacity: int,
    coefficients: tuple[float, ...],
    abs_threshold: float = DEFAULT_BALANCE_ABS_THRESHOLD,
    event_delay: float = DEFAULT_EVENT_DELAY,
) -> dict[str, float]:
    replicas = [Replica(f"replica-{i}", capacity) for i in range(num_replicas)]
    events = None
    if policy_name == "kv-events":
        events = EventsDriven(replicas, abs_threshold, event_delay)
    policy = None if events else make_policy(policy_name, balance_abs_threshold=abs_threshold)
    by_name = {r.name: r for r in replicas}
    ttfts, imbalance, busiest, means = [], [], [], []
    hit_tokens = prompt_tokens = 0
    for request in requests:
        now = request.arrival
        loads = [ReplicaLoad(r.name, in_flight=r.in_flight(now)) for r in replicas]
        counts = [load.in_flight for load in loads]
        if sum(counts):
            imbalance.append(max(counts) / statistics.fmean(counts))
        busiest.append(max(counts))
        means.append(statistics.fmean(counts))
        key = f"tenant-{request.tenant}".encode()
        if events is not None:
            events.read_events(now)
            replica = by_name[events.choose_replica(loads, request.tenant, key)]
        else:
            assert policy is not None
            replica = by_name[policy.choose(loads, key).replica]
        cached = replica.lookup_and_insert(request.tenant, request.system, now)
        start = max(now, replica.free_at)
        prompt = request.system + request.user
        prefill = prefill_seconds(coefficients, prompt - cached, cached)
        busy = service_seconds(coefficients, request, cached)
        replica.free_at = start + busy
        replica.finishes.append(replica.free_at)
        replica.work += busy
        ttfts.append(start + prefill - now)
        hit_tokens += cached
        prompt_tokens += prompt
    works = [r.work for r in replicas]
    return {
        "hit_rate": hit_tokens / prompt_tokens,
        "ttft_p50_s": _quantile(ttfts, 0.5),
        "ttft_p99_s": _quantile(ttfts, 0.99),
        "imbalance_p50": _quantile(imbalance, 0.5),
        "imbalance_p99": _quantile(imbalance, 0.99),
        "work_max_over_mean": max(works) / statistics.fmean(works),
        "max_in_flight_p99": _quantile(busiest, 0.99),
        "mean_in_flight": statistics.fmean(means),
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def arrival_rate(
    workload: Workload, coefficients: tuple[float, ...], num_replicas: int, load: float
) -> float:
    """Requests per second that keep the replicas `load` busy when nothing is cached."""
    sample, _ = make_requests(Workload(**{**workload.__dict__, "num_requests": 2000}), rate=1.0)
    mean = statistics.fmean(service_seconds(coefficients, r, 0) for r in sample)
    return load * num_replicas / mean


def fit_coefficients(model_dir: str) -> tuple[float, ...]:
    """tokenmill's start-up calibration of the step cost model on `model_dir`."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model_dir, itl_target_ms=50, max_model_len=2048))
    coefficients = engine.step_cost_coefficients
    assert coefficients is not None  # an ITL target calibrates the cost model
    return coefficients


def plot(results: dict[str, dict[str, float]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    panels = [
        ("prefix-hit rate", "hit_rate"),
        ("TTFT p50 (s)", "ttft_p50_s"),
        ("TTFT p99 (s)", "ttft_p99_s"),
        ("imbalance p99 (max/mean in flight)", "imbalance_p99"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (label, metric) in zip(axes, panels):
        ax.bar(names, [results[n][metric] for n in names], color="C0")
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--tenants", type=int, default=200)
    parser.add_argument("--zipf-s", type=float, default=1.0)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--kv-capacity", type=int, default=32768, help="tokens per replica")
    parser.add_argument("--load", type=float, default=0.7, help="utilisation without caching")
    parser.add_argument("--coefficients", type=float, nargs=4, default=DEFAULT_COEFFICIENTS)
    parser.add_argument("--fit-model", default=None, help="fit the coefficients on this model")
    parser.add_argument("--abs-thresholds", type=float, nargs="+", default=[8, 2, 0])
    parser.add_argument(
        "--event-delay",
        type=float,
        default=DEFAULT_EVENT_DELAY,
        help="kv-events: seconds from a cache change to the router reading its event",
    )
    parser.add_argument("--plot", default=None, help="write a PNG here (needs matplotlib)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    coefficients = tuple(args.coefficients)
    if args.fit_model:
        coefficients = fit_coefficients(args.fit_model)
        print("fitted coefficients:", coefficients)
    workload = Workload(num_tenants=args.tenants, zipf_s=args.zipf_s, num_requests=args.requests)
    rate = arrival_rate(workload, coefficients, args.replicas, args.load)
    requests, _ = make_requests(workload, rate)
    print(
        f"{args.replicas} replicas x {args.kv_capacity} KV tokens, {args.tenants} tenants "
        f"(Zipf s={args.zipf_s}), {args.requests} requests at {rate:.1f}/s "
        f"(load {args.load} without caching), step cost {coefficients}"
    )
    runs = [("round-robin", 8), ("least-loaded", 8)]
    runs += [("prefix-aware", t) for t in args.abs_thresholds]
    runs += [("kv-events", t) for t in args.abs_thresholds]
    results = {}
    for policy, threshold in runs:
        name = (
            policy if policy in ("round-robin", "least-loaded") else f"{policy} (abs {threshold:g})"
        )
        results[name] = simulate(
            policy, requests, args.replicas, args.kv_capacity, coefficients, threshold,
            args.event_delay,
        )  # fmt: skip
    print("| policy | hit rate | TTFT p50 (s) | TTFT p99 (s) | imbalance p50 | imbalance p99 "
          "| work max/mean | busiest in flight p99 | mean in flight |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['hit_rate']:.3f} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} "
            f"| {r['imbalance_p50']:.2f} | {r['imbalance_p99']:.2f} "
            f"| {r['work_max_over_mean']:.2f} | {r['max_in_flight_p99']:.0f} "
            f"| {r['mean_in_flight']:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot:
        title = (
            f"{args.replicas} replicas, {args.tenants} tenants (Zipf {args.zipf_s}), "
            f"load {args.load}, {args.kv_capacity} KV tokens/replica"
        )
        plot(results, args.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
