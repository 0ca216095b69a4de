"""Prometheus metrics of the inter-token-latency target (`--itl-target-ms`).

The scheduler keeps them as totals since start (`ItlTargetStats`), so they are exposed by a
collector that reads the latest totals at scrape time, rather than observed one step at a
time from the engine thread. Without a target none of them exist.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tokenmill.metrics.stats import PREFILL_BUDGET_BUCKETS, ItlTargetStats


class ItlTargetCollector(Collector):
    def __init__(self, prefix: str, model_name: str) -> None:
        self.prefix = prefix
        self.model_name = model_name
        self.stats: ItlTargetStats | None = None  # replaced (never mutated) by the engine

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        labels, values = ["model_name"], [self.model_name]
        target = GaugeMetricFamily(
            self.prefix + "itl_target_seconds",
            "The inter-token-latency target the scheduler sizes prompt chunks for.",
            labels=labels,
        )
        target.add_metric(values, stats.itl_target)
        yield target
        budget = HistogramMetricFamily(
            self.prefix + "itl_prefill_budget_tokens",
            "Prompt tokens the ITL target let into a step, per step with prompt tokens to compute.",
            labels=labels,
        )
        cumulative = list(itertools.accumulate(stats.budget_bucket_counts))
        bounds = [str(float(b)) for b in PREFILL_BUDGET_BUCKETS] + ["+Inf"]
        budget.add_metric(values, list(zip(bounds, cumulative, strict=True)), stats.budget_sum)
        yield budget
        over = CounterMetricFamily(
            self.prefix + "itl_steps_over_target",
            "Engine steps that took longer than the ITL target.",
            labels=labels,
        )
        over.add_metric(values, stats.num_steps_over_target)
        yield over
