"""The console report and the JSON result, in vLLM `bench serve`'s layout and key names, so
scripts and eyes trained on one read the other."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tokenmill.bench.metrics import LATENCY_METRICS, BenchmarkMetrics, RequestRecord

_HEADERS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
_WIDTH = 50


def percentile_word(p: float) -> str:
    """vLLM's spelling of a percentile in names: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if float(p).is_integer() else str(p)


def format_report(
    metrics: BenchmarkMetrics,
    slos: dict[str, float] | None = None,
    title: str = "Serving Benchmark Result",
) -> str:
    lines = [f" {title} ".center(_WIDTH, "=")]

    def row(label: str, value: float | int, decimals: int = 2) -> None:
        text = f"{value:<10.{decimals}f}" if isinstance(value, float) else f"{value:<10}"
        lines.append(f"{label:<40} {text}")

    row("Successful requests:", metrics.completed)
    row("Failed requests:", metrics.failed)
    row("Benchmark duration (s):", metrics.duration)
    row("Total input tokens:", metrics.total_input)
    row("Total generated tokens:", metrics.total_output)
    row("Request throughput (req/s):", metrics.request_throughput)
    if metrics.request_goodput is not None:
        row("Request goodput (req/s):", metrics.request_goodput)
        slo_text = ", ".join(f"{k} <= {v:g} ms" for k, v in (slos or {}).items())
        lines.append(f"{'  SLO:':<40} {slo_text}")
    row("Output token throughput (tok/s):", metrics.output_throughput)
    row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s)
    row("Peak concurrent requests:", metrics.max_concurrent_requests)
    row("Total Token throughput (tok/s):", metrics.total_token_throughput)
    if metrics.client_cpu_fraction is not None:
        row("Client CPU use (cores):", metrics.client_cpu_fraction)
    for name in LATENCY_METRICS:
        stats = metrics.latency[name]
        lines.append(_HEADERS[name].center(_WIDTH, "-"))
        upper = name.upper()
        row(f"Mean {upper} (ms):", stats.mean)
        row(f"Median {upper} (ms):", stats.median)
        for p, value in stats.percentiles.items():
            row(f"P{percentile_word(p)} {upper} (ms):", value)
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def metrics_to_dict(metrics: BenchmarkMetrics) -> dict[str, Any]:
    """Flat, with vLLM's key names (`mean_ttft_ms`, `p99_itl_ms`, ...)."""
    out: dict[str, Any] = {
        "duration": metrics.duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.request_goodput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "client_cpu_fraction": metrics.client_cpu_fraction,
    }
    for name in LATENCY_METRICS:
        stats = metrics.latency[name]
        out[f"mean_{name}_ms"] = stats.mean
        out[f"median_{name}_ms"] = stats.median
        out[f"std_{name}_ms"] = stats.std
        for p, value in stats.percentiles.items():
            out[f"p{percentile_word(p)}_{name}_ms"] = value
    return out


def records_to_dict(records: list[RequestRecord]) -> dict[str, Any]:
    """One record per request: its client-side timeline, token counts and error. Times are
    rounded to the microsecond and the generated text is left out (a random model's text is
    noise, and it would make up most of the file)."""
    return {"requests": [_compact(r) for r in records]}


def _compact(record: RequestRecord) -> dict[str, Any]:
    out = asdict(record)
    del out["generated_text"]
    for key, value in out.items():
        if isinstance(value, float):
            out[key] = round(value, 6)
    out["itl"] = [round(gap, 6) for gap in record.itl]
    return out


@dataclass
class ServeResult:
    metrics: BenchmarkMetrics
    records: list[RequestRecord]
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**self.info, **metrics_to_dict(self.metrics), **records_to_dict(self.records)}
