"""The router's `/metrics`: its own counters and gauges, then every healthy replica's
metrics with a `replica` label added (so one Prometheus scrape sees the whole deployment)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.entrypoints.router.balancing.replicas import ReplicaSet

PREFIX = "tokenmill:router_"


class RouterMetrics:
    def __init__(self, *replica_sets: ReplicaSet) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            PREFIX + "requests",
            "Requests routed, by replica and routing decision (round_robin, least_loaded, "
            "prefix_affinity, prefix_spill)",
            ["replica", "decision"],
            registry=self.registry,
        )
        self.failures = Counter(
            PREFIX + "replica_failures",
            "Requests a replica failed: connect (retried on another replica), during the "
            "request, or during a stream",
            ["replica", "stage"],
            registry=self.registry,
        )
        self.registry.register(_ReplicaGauges(replica_sets))


class _ReplicaGauges:
    """Gauges read from the replica sets at scrape time."""

    def __init__(self, replica_sets: tuple[ReplicaSet, ...]) -> None:
        self.replica_sets = replica_sets

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            PREFIX + "replica_healthy", "1 while the replica is in rotation", labels=["replica"]
        )
        in_flight = GaugeMetricFamily(
            PREFIX + "replica_in_flight",
            "Requests the router has open on the replica",
            labels=["replica"],
        )
        for replica in (r for s in self.replica_sets for r in s.replicas.values()):
            healthy.add_metric([replica.url], float(replica.healthy))
            in_flight.add_metric([replica.url], replica.in_flight)
        yield healthy
        yield in_flight


async def aggregated_metrics(
    metrics: RouterMetrics, client: httpx.AsyncClient, *replica_sets: ReplicaSet
) -> bytes:
    """The router's own metrics, then each healthy replica's, labelled `replica`."""
    healthy = [(r.url, s.timeout) for s in replica_sets for r in s.healthy()]
    urls = [url for url, _ in healthy]
    texts = await asyncio.gather(*(_scrape(client, url, timeout) for url, timeout in healthy))
    merged: dict[str, Metric] = {}
    for url, text in zip(urls, texts):
        if text is None:
            continue
        for family in text_string_to_metric_families(text):
            metric = merged.setdefault(
                family.name, Metric(family.name, family.documentation, family.type)
            )
            for sample in family.samples:
                labels = {**sample.labels, "replica": url}
                metric.add_sample(sample.name, labels, sample.value, sample.timestamp)
    replica_registry = CollectorRegistry()
    replica_registry.register(_Fixed(list(merged.values())))
    return generate_latest(metrics.registry) + generate_latest(replica_registry)


async def _scrape(client: httpx.AsyncClient, url: str, timeout: float) -> str | None:
    try:
        response = await client.get(f"{url}/metrics", timeout=timeout)
        response.raise_for_status()
    except httpx.HTTPError:
        return None  # a replica that cannot answer is left out of this scrape
    return response.text


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families
