"""`tokenmill bench sweep`: one workload at rising load, to find where latency breaks.

Each point is a full `bench serve` run (same requests, same seed) at one concurrency or
request rate. The knee is the highest load before the first point whose p95 (by default)
TTFT, TPOT or E2EL misses its SLO: past it, more load buys queueing, not throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.bench.metrics import SLO_METRICS, parse_percentiles
from tokenmill.bench.plots import SweepPoint
from tokenmill.bench.report import ServeResult, metrics_to_dict
from tokenmill.bench.serve import (
    LoadSettings,
    Target,
    add_target_args,
    prepare_target,
    save_json,
)

TABLE_PERCENTILES = (50.0, 95.0, 99.0)
LOAD_NAMES = {"max_concurrency": "max concurrency", "request_rate": "request rate (req/s)"}


@dataclass
class SweepResult:
    load_kind: str  # "max_concurrency" | "request_rate"
    points: list[SweepPoint]
    results: list[ServeResult]
    knee: float | None
    knee_percentile: float
    slos: dict[str, float]

    @property
    def load_name(self) -> str:
        return LOAD_NAMES[self.load_kind]

    def to_dict(self) -> dict[str, Any]:
        return {
            "load_kind": self.load_kind,
            "loads": [_json_load(p.load) for p in self.points],
            "knee": None if self.knee is None else _json_load(self.knee),
            "knee_percentile": self.knee_percentile,
            "goodput_slos": self.slos,
            "points": [
                {"load": _json_load(p.load), **metrics_to_dict(r.metrics)}
                for p, r in zip(self.points, self.results)
            ],
            "results": [r.to_dict() for r in self.results],
        }


def _json_load(load: float) -> float | str:
    return "inf" if math.isinf(load) else load


def _show_load(load: float) -> str:
    return f"{load:g}"


def parse_loads(text: str, integer: bool) -> list[float]:
    """`"1,2,4,inf"` -> sorted loads; concurrencies must be whole numbers."""
    try:
        loads = sorted(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"a load list is numbers separated by commas, got {text!r}") from None
    if not loads or any(x <= 0 for x in loads):
        raise ValueError(f"loads must be > 0, got {text!r}")
    if integer and any(not x.is_integer() for x in loads):
        raise ValueError(f"concurrencies must be whole numbers, got {text!r}")
    return loads


def find_knee(points: list[SweepPoint], slos: dict[str, float], percentile: float) -> float | None:
    """The highest load before the first point missing an SLO at `percentile`; None when no
    SLO applies or the lowest load already misses."""
    checked = {name: slo for name, slo in slos.items() if name in SLO_METRICS}
    if not checked:
        return None
    knee = None
    for point in sorted(points, key=lambda p: p.load):
        if any(point.latency_ms[name][percentile] > slo for name, slo in checked.items()):
            break
        knee = point.load
    return knee


def to_point(load: float, result: ServeResult) -> SweepPoint:
    m = result.metrics
    return SweepPoint(
        load=load,
        output_throughput=m.output_throughput,
        request_throughput=m.request_throughput,
        request_goodput=m.request_goodput,
        latency_ms={name: dict(stats.percentiles) for name, stats in m.latency.items()},
    )


def run_sweep(
    target: Target, load_kind: str, loads: list[float], base: LoadSettings, knee_percentile: float
) -> SweepResult:
    points, results = [], []
    for load in loads:
        settings = _load_at(base, load_kind, load)
        print(f"--- {LOAD_NAMES[load_kind]} = {_show_load(load)}: {settings.describe()}")
        result = asyncio.run(target.run(settings))
        points.append(to_point(load, result))
        results.append(result)
    knee = find_knee(points, target.slos, knee_percentile)
    return SweepResult(load_kind, points, results, knee, knee_percentile, target.slos)


def _load_at(base: LoadSettings, load_kind: str, load: float) -> LoadSettings:
    if load_kind == "max_concurrency":
        return LoadSettings(base.request_rate, base.burstiness, int(load), base.seed)
    return LoadSettings(load, base.burstiness, base.max_concurrency, base.seed)


def format_sweep_table(sweep: SweepResult) -> str:
    head = f"{'load':>8} {'req/s':>7} {'out tok/s':>10} {'goodput':>8}"
    for metric in ("TTFT", "TPOT", "ITL"):
        head += "".join(f" {f'{metric} p{p:g}':>10}" for p in TABLE_PERCENTILES)
    lines = [head + "   (latencies in ms)"]
    for point in sweep.points:
        goodput = "-" if point.request_goodput is None else f"{point.request_goodput:.2f}"
        line = (
            f"{_show_load(point.load):>8} {point.request_throughput:>7.2f} "
            f"{point.output_throughput:>10.1f} {goodput:>8}"
        )
        for metric in ("ttft", "tpot", "itl"):
            line += "".join(f" {point.latency_ms[metric][p]:>10.1f}" for p in TABLE_PERCENTILES)
        lines.append(line)
    lines.append(_knee_line(sweep))
    return "\n".join(lines)


def _knee_line(sweep: SweepResult) -> str:
    if not any(name in SLO_METRICS for name in sweep.slos):
        return "knee: give --goodput ttft:MS tpot:MS to find it"
    slo = ", ".join(
        f"p{sweep.knee_percentile:g} {k.upper()} <= {v:g} ms" for k, v in sweep.slos.items()
    )
    if sweep.knee is None:
        return f"knee: none (the lowest load already misses {slo})"
    return f"knee: {sweep.load_name} = {_show_load(sweep.knee)} (highest load meeting {slo})"


def plot_sweep(sweep: SweepResult, out_dir: Path, timeline_load: float | None) -> list[Path]:
    from tokenmill.bench import plots

    chosen = _timeline_index(sweep, timeline_load)
    result = sweep.results[chosen]
    load = _show_load(sweep.points[chosen].load)
    return [
        plots.plot_throughput_vs_load(
            sweep.points, sweep.load_name, out_dir / "throughput_vs_load.png"
        ),
        plots.plot_latency_vs_load(
            sweep.points, sweep.load_name, out_dir / "latency_vs_load.png", sweep.slos, sweep.knee
        ),
        plots.plot_timeline(
            result.records, out_dir / "timeline.png", f"{sweep.load_name} = {load}"
        ),
    ]


def _timeline_index(sweep: SweepResult, wanted: float | None) -> int:
    """The point to draw a timeline for: the one asked for, else the knee, else the last."""
    loads = [p.load for p in sweep.points]
    for choice in (wanted, sweep.knee):
        if choice is not None:
            if choice not in loads:
                raise ValueError(f"--timeline-load {choice:g} is not one of the loads {loads}")
            return loads.index(choice)
    return len(loads) - 1


# ---- command line ----------------------------------------------------------------------------


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    add_target_args(parser)
    group = parser.add_argument_group("sweep (give exactly one list)")
    loads = group.add_mutually_exclusive_group(required=True)
    loads.add_argument(
        "--max-concurrency-list", default=None, metavar="1,2,4,8", help="concurrency caps to run"
    )
    loads.add_argument(
        "--request-rate-list",
        default=None,
        metavar="1,2,4,inf",
        help="request rates to run (per s)",
    )
    group.add_argument(
        "--request-rate", type=float, default=math.inf, help="arrival rate of a concurrency sweep"
    )
    group.add_argument(
        "--max-concurrency", type=int, default=None, help="concurrency cap of a request-rate sweep"
    )
    group.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)"
    )
    group.add_argument(
        "--knee-percentile",
        type=float,
        default=95.0,
        help="the latency percentile checked against the --goodput SLOs to find the knee",
    )
    group.add_argument(
        "--timeline-load",
        type=float,
        default=None,
        help="the point whose per-request timeline is plotted (default: knee)",
    )


def run_sweep_cli(args: argparse.Namespace) -> int:
    if args.max_concurrency_list is not None:
        load_kind, loads = "max_concurrency", parse_loads(args.max_concurrency_list, True)
    else:
        load_kind, loads = "request_rate", parse_loads(args.request_rate_list, False)
    percentiles = set(parse_percentiles(args.percentiles))
    wanted = {*TABLE_PERCENTILES, args.knee_percentile}
    args.percentiles = ",".join(f"{p:g}" for p in sorted(percentiles | wanted))
    base = LoadSettings(args.request_rate, args.burstiness, args.max_concurrency, args.seed)
    target = prepare_target(args)
    sweep = run_sweep(target, load_kind, loads, base, args.knee_percentile)
    print(format_sweep_table(sweep))
    if args.save_result:
        save_json(sweep.to_dict(), args.save_result)
    if args.plot:
        for path in plot_sweep(sweep, Path(args.plot), args.timeline_load):
            print(f"wrote {path}")
    return 0
