"""One configuration's result in the ITL-under-prefill benchmark, and its table row
(scenario.py offline, serving.py over HTTP)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

TABLE_HEADER = (
    "| configuration | steady ITL | p99 ITL while admitted | worst ITL | p99 / steady "
    "| TTFT long prompt | steps to its first token | throughput while admitted "
    "| steps over target |\n|---|---|---|---|---|---|---|---|---|"
)


@dataclass
class Run:
    steady: float  # seconds: median inter-token latency before the long prompt arrives
    admission_itls: list[float]  # inter-token latencies from its arrival to its first token
    ttft: float
    throughput: float  # tokens computed per second after its arrival
    steps_over_target: int | None
    num_steps: int  # engine steps (offline) or a stream's tokens (served) until its first token
    target: float | None = None  # seconds: the ITL target the run had, if any
    # served: the streams' token positions of the window (median first and last gap index)
    window: tuple[int, int] | None = None
    # served: the median gap at those positions in a control run without the long prompt
    # (the streams' own step at the same context lengths: what they would have seen)
    control_steady: float | None = None
    control_p99: float | None = None  # and the p99 there (the tail a run without it has)
    # served: each admission gap's token position (its index among its stream's gaps)...
    admission_positions: list[int] | None = None
    # ...and the control's step at each position (a running median: `ControlSteps`)
    control_steps: ControlSteps | None = None

    @property
    def p99(self) -> float:
        return percentile(self.admission_itls, 0.99)

    @property
    def relative_p99(self) -> float | None:
        """The p99 of each admission gap over the control's step at its own token position:
        how much slower than its own steady step a stream's step was, there and then."""
        if self.admission_positions is None or self.control_steps is None:
            return None
        steps = self.control_steps
        ratios = [
            gap / steps.at(position)
            for gap, position in zip(self.admission_itls, self.admission_positions, strict=True)
        ]
        return percentile(ratios, 0.99)


@dataclass
class ControlSteps:
    """A control run's step by token position: the median of its streams' gaps at positions
    within `HALF_WIDTH` of it (the streams step together, so one position holds one step's
    gaps; the neighbours smooth one step's jitter out of the reference). `relative_p99` is
    the control's own gaps' p99 over it: the floor any run's relative p99 sits on."""

    HALF_WIDTH = 4
    by_position: dict[int, float]
    relative_p99: float

    @classmethod
    def from_gaps(cls, gaps: dict[int, list[float]]) -> ControlSteps:
        """`gaps`: the control streams' gaps at each position."""
        positions = sorted(gaps)
        width = cls.HALF_WIDTH
        near = {p: range(p - width, p + width + 1) for p in positions}
        by_position = {
            p: statistics.median(g for q in near[p] for g in gaps.get(q, [])) for p in positions
        }
        ratios = [g / by_position[p] for p in positions for g in gaps[p]]
        return cls(by_position, percentile(ratios, 0.99))

    def at(self, position: int) -> float:
        """The step at `position`, or at the nearest position the control has."""
        if position in self.by_position:
            return self.by_position[position]
        return self.by_position[min(self.by_position, key=lambda p: abs(p - position))]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def report(label: str, runs: list[Run]) -> str:
    """The table row of `runs` (repeats of one configuration): medians over the repeats."""

    def median(values) -> float:
        return statistics.median(list(values))

    steady = median(r.steady for r in runs)
    p99 = median(r.p99 for r in runs)
    worst = median(max(r.admission_itls) for r in runs)
    over = [r.steps_over_target for r in runs if r.steps_over_target is not None]
    return (
        f"| {label} | {1000 * steady:.0f} ms | {1000 * p99:,.0f} ms | {1000 * worst:,.0f} ms "
        f"| {p99 / steady:.1f}x | {median(r.ttft for r in runs):.1f} s "
        f"| {median(r.num_steps for r in runs):.0f} "
        f"| {median(r.throughput for r in runs):,.0f} tok/s "
        f"| {median(over) if over else '-'} |"
    )


def goal_check(label: str, baseline: list[Run], runs: list[Run]) -> str:
    """Issue 19's goal for `runs` (a target configuration) against `baseline` (no target):
    p99 ITL within 2x steady, TTFT within 2x, throughput within 10%; medians over repeats."""
    steady = statistics.median(r.steady for r in runs)
    p99 = statistics.median(r.p99 for r in runs)
    ttft = statistics.median(r.ttft for r in runs) / statistics.median(r.ttft for r in baseline)
    throughput = statistics.median(r.throughput for r in runs) / statistics.median(
        r.throughput for r in baseline
    )
    targets = [r.target for r in runs if r.target is not None]
    target = f", target {1000 * statistics.median(targets):.0f} ms" if targets else ""
    verdicts = [
        f"p99/steady {p99 / steady:.2f}x ({'ok' if p99 <= 2 * steady else 'over 2x'})",
        f"TTFT {ttft:.2f}x ({'ok' if ttft <= 2 else 'over 2x'})",
        f"throughput {throughput:.2f}x ({'ok' if throughput >= 0.9 else 'under 0.9x'})",
    ]
    return f"{label}{target}: " + ", ".join(verdicts)


def disaggregation_check(label: str, chunked: list[Run], runs: list[Run]) -> str:
    """Issue 32's goal for `runs` (a prefill/decode pair) against `chunked` (one engine with
    the ITL target): the streams' p99 ITL within 1.2x their own steady step, the long
    prompt's TTFT no worse than the chunked engine's; throughput beside it."""
    steady = statistics.median(r.steady for r in runs)
    p99 = statistics.median(r.p99 for r in runs)
    ttft = statistics.median(r.ttft for r in runs) / statistics.median(r.ttft for r in chunked)
    throughput = statistics.median(r.throughput for r in runs) / statistics.median(
        r.throughput for r in chunked
    )
    relative = [r.relative_p99 for r in runs if r.relative_p99 is not None]
    per_gap = ""
    if relative:
        ratio = statistics.median(relative)
        floors = [r.control_steps.relative_p99 for r in runs if r.control_steps is not None]
        per_gap = (
            f"p99 of each gap over its own steady step (the control's at its token position) "
            f"{ratio:.2f}x ({'ok' if ratio <= 1.2 else 'over 1.2x'}; the control's own "
            f"{statistics.median(floors):.2f}x), "
        )
    controls = [r.control_steady for r in runs if r.control_steady is not None]
    same_context = ""
    if controls:
        control = statistics.median(controls)
        verdict = "" if relative else f" ({'ok' if p99 <= 1.2 * control else 'over 1.2x'})"
        floors = [r.control_p99 / r.control_steady for r in runs if r.control_p99 is not None]
        floor = f", its own p99 {statistics.median(floors):.2f}x that" if floors else ""
        same_context = (
            f"p99 over the control's median in the window {p99 / control:.2f}x{verdict} (the "
            f"control run's {1000 * control:.0f} ms{floor}), "
        )
    verdicts = [
        per_gap
        + same_context
        + f"p99/steady before arrival {p99 / steady:.2f}x"
        + ("" if controls else f" ({'ok' if p99 <= 1.2 * steady else 'over 1.2x'})"),
        f"TTFT {ttft:.2f}x the chunked engine's ({'ok' if ttft <= 1 else 'worse'})",
        f"throughput {throughput:.2f}x",
    ]
    return f"{label}: " + ", ".join(verdicts)
