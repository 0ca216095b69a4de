"""Per-request timelines and the serving metrics computed from them.

Definitions follow vLLM's `bench serve` exactly, so numbers compare across tools:

- TTFT: from sending the request to the first streamed chunk that carries a choice.
- ITL: every gap between consecutive such chunks, pooled over all requests.
- TPOT: per request, (E2E latency - TTFT) / (output tokens - 1); requests with one output
  token have no TPOT (left out of its statistics, but count as meeting a TPOT SLO).
- E2E latency (E2EL): from sending the request to its last chunk.
- Goodput: completed requests meeting every given SLO (value <= SLO), per second of the
  benchmark's duration.

Statistics of an empty list are 0, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds; `*_time` are offsets from the
    benchmark's start, the rest are durations."""

    index: int
    prompt_len: int  # the server's usage.prompt_tokens when reported, else the dataset's
    expected_output_len: int
    category: str = "default"
    scheduled_time: float = 0.0  # when the arrival process released it
    start_time: float = 0.0  # when it was sent (later if --max-concurrency made it wait)
    success: bool = False
    error: str = ""
    output_tokens: int = 0  # usage.completion_tokens when reported, else counted by tokenizer
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2E
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def first_token_time(self) -> float:
        return self.start_time + self.ttft

    @property
    def end_time(self) -> float:
        return self.start_time + self.latency


@dataclass
class LatencyStats:
    """One latency metric in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[float, float]  # percentile -> ms

    @classmethod
    def of(cls, seconds: list[float], percentiles: tuple[float, ...]) -> LatencyStats:
        values = np.asarray(seconds or [0.0], dtype=np.float64) * 1000.0
        return cls(
            mean=float(np.mean(values)),
            median=float(np.median(values)),
            std=float(np.std(values)),
            percentiles={p: float(np.percentile(values, p)) for p in percentiles},
        )


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None  # None when no SLO was given
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float  # peak over 1 s buckets, one token per chunk assumed
    max_concurrent_requests: int
    latency: dict[str, LatencyStats]  # "ttft" | "tpot" | "itl" | "e2el"
    # CPU the load generator itself used, in cores (1.0 = one core busy all the time). On a
    # small machine shared with the server, a high value means the client shaped the result.
    client_cpu_fraction: float | None = None


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> `{"ttft": 500.0, "tpot": 50.0}` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {SLO_METRICS}, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: an SLO must be >= 0 ms")
    return slos


def parse_percentiles(text: str) -> tuple[float, ...]:
    """`"50,90,99"` -> `(50.0, 90.0, 99.0)`."""
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--percentiles takes numbers like 50,90,99, got {text!r}") from None
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--percentiles must be in [0, 100], got {text!r}")
    return values


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A successful request whose every SLO'd metric is within its SLO (inclusive)."""
    if not record.success:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.latency}
    return all(values[name] * 1000.0 <= slo for name, slo in slos.items())


def compute_metrics(
    records: list[RequestRecord],
    duration: float,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    slos: dict[str, float] | None = None,
) -> BenchmarkMetrics:
    done = [r for r in records if r.success]
    per_second = 1.0 / duration if duration > 0 else 0.0
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    tpots = [t for t in (r.tpot for r in done) if t is not None]
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": tpots,
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    goodput = None
    if slos:
        goodput = sum(meets_slos(r, slos) for r in done) * per_second
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(records) - len(done),
        duration=duration,
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(done) * per_second,
        request_goodput=goodput,
        output_throughput=total_output * per_second,
        total_token_throughput=(total_input + total_output) * per_second,
        max_output_tokens_per_s=_peak_chunks_per_second(done),
        max_concurrent_requests=_peak_concurrency(done),
        latency={name: LatencyStats.of(samples[name], percentiles) for name in LATENCY_METRICS},
    )


def chunk_times(record: RequestRecord) -> list[float]:
    """When each streamed chunk arrived, as offsets from the benchmark's start."""
    if not record.success:
        return []
    times = [record.first_token_time]
    for gap in record.itl:
        times.append(times[-1] + gap)
    return times


def _peak_chunks_per_second(records: list[RequestRecord]) -> float:
    times = [t for r in records for t in chunk_times(r)]
    if not times:
        return 0.0
    counts = np.bincount(np.floor(np.asarray(times)).astype(np.int64).clip(min=0))
    return float(counts.max())


def _peak_concurrency(records: list[RequestRecord]) -> int:
    """Most requests in flight at once (sent and not yet finished)."""
    events = sorted(
        [(r.start_time, 1) for r in records] + [(r.end_time, -1) for r in records],
        key=lambda e: (e[0], e[1]),  # an end at the same instant as a start comes first
    )
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak
