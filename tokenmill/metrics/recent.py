"""The latest latency observations, with their times, for percentiles over a sliding window.

Prometheus histograms answer "how many so far in each bucket"; the dashboard wants exact
percentiles and goodput (requests inside every SLO at once) over the last minutes. So the
metrics code appends each observation it makes anyway to a ring, stamped with the wall-clock
time the engine already took for it, and the dashboard reads what is new a few times a second.
"""

from __future__ import annotations

from typing import NamedTuple

from tokenmill.metrics.ring import Ring
from tokenmill.outputs import RequestMetrics

# Per-token observations (ITL) come up to ~100 times per step at batch 64: a minute or more
# of a busy server. Per-request ones come far less often.
TOKEN_HISTORY = 65536
REQUEST_HISTORY = 8192


# One TTFT or ITL observation: (wall clock of the token, seconds). A plain tuple: up to ~100
# are made per step, and a NamedTuple costs twice as much to build.
Observation = tuple[float, float]


class FinishedRecord(NamedTuple):
    """One finished request's latencies (seconds), as vLLM's per-request histograms take them."""

    time: float  # wall clock at finish
    ttft: float | None  # arrival -> first token (None: it produced none)
    tpot: float | None  # decode time / (output tokens - 1); None under 2 tokens
    e2e: float  # arrival -> finish
    queue_time: float | None  # arrival -> first scheduled
    num_output_tokens: int

    @classmethod
    def of(cls, m: RequestMetrics, num_output_tokens: int) -> FinishedRecord:
        finished = m.finished_time if m.finished_time is not None else m.arrival_time
        first, last = m.first_token_time, m.last_token_time
        tpot = None
        if first is not None and last is not None and num_output_tokens > 1:
            tpot = (last - first) / (num_output_tokens - 1)
        return cls(
            time=finished,
            ttft=None if first is None else first - m.arrival_time,
            tpot=tpot,
            e2e=finished - m.arrival_time,
            queue_time=None
            if m.first_scheduled_time is None
            else m.first_scheduled_time - m.arrival_time,
            num_output_tokens=num_output_tokens,
        )


class RecentLatencies:
    """Filled on the engine thread by `EngineMetrics`; read from any thread."""

    def __init__(self) -> None:
        self.ttft: Ring[Observation] = Ring(REQUEST_HISTORY)
        self.itl: Ring[Observation] = Ring(TOKEN_HISTORY)
        self.finished: Ring[FinishedRecord] = Ring(REQUEST_HISTORY)
