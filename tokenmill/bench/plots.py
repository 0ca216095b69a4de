"""PNG plots of benchmark results (matplotlib, headless, small files for committing).

The per-request timeline shows only what a client can see: when a request arrived, when it
was sent (later if the client's --max-concurrency held it back), its first token and its end.
"Waiting for the first token" lumps the server's queueing and the prefill together; telling
them apart needs server-side timestamps, which an OpenAI-compatible API does not expose.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.bench.client import BenchError
from tokenmill.bench.metrics import RequestRecord

if TYPE_CHECKING:
    from tokenmill.bench.report import ServeResult

_DPI = 80
_COLORS = {"wait": "#bbbbbb", "first": "#f28e2b", "stream": "#4e79a7", "fail": "#e15759"}


# matplotlib is an optional extra: serving and the tests of the engine do not need it.
MISSING_MATPLOTLIB = 'plots need matplotlib: pip install "tokenmill[bench]" (or matplotlib)'


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def require_matplotlib() -> None:
    """Fail before a benchmark runs, not after, when its plots cannot be drawn."""
    if not matplotlib_available():
        raise BenchError(MISSING_MATPLOTLIB)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede importing pyplot
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    _pyplot().close(fig)
    return path


def plot_serve_result(result: ServeResult, out_dir: Path) -> list[Path]:
    title = _load_title(result.info)
    return [
        plot_timeline(result.records, out_dir / "timeline.png", title),
        plot_latency_cdf(result.records, out_dir / "latency_cdf.png", title),
    ]


def _load_title(info: dict) -> str:
    rate = info.get("request_rate", "inf")
    cap = info.get("max_concurrency") or "none"
    return f"rate {rate} req/s, max concurrency {cap}"


def plot_timeline(records: Sequence[RequestRecord], path: Path, title: str = "") -> Path:
    """One row per request: arrival tick, client wait, waiting for the first token, streaming."""
    plt = _pyplot()
    rows = sorted(records, key=lambda r: (r.scheduled_time, r.index))
    fig, ax = plt.subplots(figsize=(8, max(3.4, min(8.0, 2.0 + 0.06 * len(rows)))))
    height = 0.8
    for y, r in enumerate(rows):
        ax.plot([r.scheduled_time] * 2, [y - 0.45, y + 0.45], color="black", linewidth=0.6)
        ax.barh(
            y,
            r.start_time - r.scheduled_time,
            left=r.scheduled_time,
            height=height,
            color=_COLORS["wait"],
        )
        if not r.success:
            ax.plot(r.start_time, y, marker="x", color=_COLORS["fail"])
            continue
        ax.barh(y, r.ttft, left=r.start_time, height=height, color=_COLORS["first"])
        ax.barh(
            y, r.latency - r.ttft, left=r.first_token_time, height=height, color=_COLORS["stream"]
        )
    handles = [
        plt.Line2D([], [], color="black", linewidth=1, label="arrival"),
        plt.Rectangle((0, 0), 1, 1, color=_COLORS["wait"], label="client wait (max-concurrency)"),
        plt.Rectangle(
            (0, 0),
            1,
            1,
            color=_COLORS["first"],
            label="waiting for 1st token (server queue + prefill)",
        ),
        plt.Rectangle((0, 0), 1, 1, color=_COLORS["stream"], label="streaming (decode)"),
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4,
              fontsize=7, frameon=False)  # fmt: skip
    ax.set_xlabel("seconds since the benchmark started")
    ax.set_ylabel("request (by arrival)")
    ax.set_ylim(-1, len(rows))
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_title(f"Per-request timeline, as the client sees it; {title}", fontsize=9)
    return _save(fig, path)


def plot_latency_cdf(records: Sequence[RequestRecord], path: Path, title: str = "") -> Path:
    """Cumulative distributions of TTFT, TPOT, ITL and E2E latency (ms)."""
    plt = _pyplot()
    done = [r for r in records if r.success]
    samples = {
        "TTFT": [r.ttft for r in done],
        "TPOT": [t for t in (r.tpot for r in done) if t is not None],
        "ITL": [g for r in done for g in r.itl],
        "E2EL": [r.latency for r in done],
    }
    fig, axes = plt.subplots(1, 4, figsize=(10, 2.8))
    for ax, (name, values) in zip(axes, samples.items()):
        values = sorted(v * 1000 for v in values)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of samples")
    fig.suptitle(f"Latency distributions; {title}", fontsize=9)
    return _save(fig, path)


@dataclass
class SweepPoint:
    """One load level of a sweep, reduced to what the sweep plots and tables show."""

    load: float
    output_throughput: float
    request_throughput: float
    request_goodput: float | None
    latency_ms: dict[str, dict[float, float]]  # metric -> percentile -> ms


def plot_throughput_vs_load(points: list[SweepPoint], load_name: str, path: Path) -> Path:
    plt = _pyplot()
    xs = [_finite(p.load) for p in points]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(xs, [p.output_throughput for p in points], marker="o", label="output tok/s")
    ax.set_xlabel(load_name)
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    right = ax.twinx()
    right.plot(  # dotted: on a fixed workload it runs parallel to tokens/s
        xs,
        [p.request_throughput for p in points],
        marker="s",
        markersize=3,
        linestyle=":",
        color="#59a14f",
        label="requests/s",
    )
    if all(p.request_goodput is not None for p in points):
        right.plot(
            xs,
            [p.request_goodput for p in points],
            marker="^",
            color="#e15759",
            linestyle="--",
            label="goodput req/s",
        )
    right.set_ylabel("requests/s")
    lines = ax.get_lines() + right.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], fontsize=7, loc="upper left")
    ax.set_title("Throughput vs load", fontsize=9)
    _mark_infinite(ax, points)
    _log_scale_if_wide(ax, points)
    return _save(fig, path)


def plot_latency_vs_load(
    points: list[SweepPoint],
    load_name: str,
    path: Path,
    slos: dict[str, float] | None = None,
    knee: float | None = None,
) -> Path:
    """TTFT, TPOT and ITL percentiles against load, with the SLO lines and the knee."""
    plt = _pyplot()
    xs = [_finite(p.load) for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    for ax, metric in zip(axes, ("ttft", "tpot", "itl")):
        for p in sorted(points[0].latency_ms[metric]):
            ax.plot(xs, [pt.latency_ms[metric][p] for pt in points], marker=".", label=f"p{p:g}")
        if slos and metric in slos:
            ax.axhline(slos[metric], color=_COLORS["fail"], linestyle=":", label="SLO")
        if knee is not None:
            ax.axvline(_finite(knee), color="gray", linestyle="--", label="knee")
        ax.set_xlabel(load_name)
        ax.set_ylabel(f"{metric.upper()} (ms)")
        ax.grid(alpha=0.3)
        _mark_infinite(ax, points)
        _log_scale_if_wide(ax, points)
    axes[0].legend(fontsize=7)
    fig.suptitle("Latency percentiles vs load", fontsize=9)
    return _save(fig, path)


def plot_compare(
    names: list[str], metrics: dict[str, list[float | None]], path: Path, title: str
) -> Path:
    """One small bar chart per metric, one bar per configuration (missing = unavailable)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(metrics), figsize=(2.6 * len(metrics), 3.0))
    axes = list(axes) if len(metrics) > 1 else [axes]
    colors = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2"]
    for ax, (label, values) in zip(axes, metrics.items()):
        heights = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(range(len(names)), heights, color=colors[: len(names)])
        for bar, value in zip(bars, values):
            text = "n/a" if value is None else format_value(value)
            ax.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax.set_xticks(range(len(names)), names, fontsize=7, rotation=15)
        ax.set_title(label, fontsize=8)
        ax.margins(y=0.15)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def format_value(value: float) -> str:
    """Three significant figures without scientific notation: 3168, 39.2, 0.512."""
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"


def _log_scale_if_wide(ax, points: list[SweepPoint]) -> None:
    """Loads that double each step (1, 2, 4 ... 64) read best on a log axis."""
    finite = [p.load for p in points if math.isfinite(p.load)]
    if finite and min(finite) > 0 and max(finite) / min(finite) >= 8:
        ax.set_xscale("log", base=2)
        ax.set_xticks(finite, [f"{x:g}" for x in finite])
        ax.minorticks_off()


def _finite(load: float) -> float:
    """An `inf` load (all at once) has no x position: it becomes a gap in the line."""
    return load if math.isfinite(load) else math.nan


def _mark_infinite(ax, points: list[SweepPoint]) -> None:
    """An `inf` rate has no place on the axis: say so instead of dropping it silently."""
    if any(not math.isfinite(p.load) for p in points):
        ax.text(
            0.99,
            0.02,
            "inf point not drawn",
            transform=ax.transAxes,
            ha="right",
            fontsize=6,
            color="gray",
        )
