"""The router's view of its replicas: health (from periodic `/health` checks), load (from
periodic `/metrics` scrapes plus the router's own count of requests in flight)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.entrypoints.http.responses.ids import replica_tag
from tokenmill.entrypoints.router.balancing.policies import ReplicaLoad

logger = logging.getLogger("tokenmill.router")

WAITING = "tokenmill:num_requests_waiting"
KV_USAGE = "tokenmill:kv_cache_usage_perc"


@dataclass
class Replica:
    url: str  # http://host:port, no trailing slash
    healthy: bool = False  # a replica is in rotation only once a health check has passed
    in_flight: int = 0
    waiting: float = 0.0
    kv_usage: float = 0.0
    tag: str = field(init=False)  # in the ids of the responses it stores (responses/ids.py)

    def __post_init__(self) -> None:
        self.tag = replica_tag(self.url)

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(self.url, self.in_flight, self.waiting, self.kv_usage)


class ReplicaSet:
    """The replicas and the loop that checks them every `interval` seconds."""

    def __init__(self, urls: list[str], interval: float = 1.0, timeout: float = 2.0) -> None:
        if not urls:
            raise ValueError("the router needs at least one --backend")
        self.replicas = {url: Replica(url) for url in (u.rstrip("/") for u in urls)}
        self.interval = interval
        self.timeout = timeout
        self._unscraped: set[str] = set()  # replicas whose /metrics refused us (logged once)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def mark_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            replica.healthy = False
            logger.warning(
                "replica %s taken out of rotation: %s (%s)", replica.url, reason, self.capacity()
            )

    def capacity(self) -> str:
        return f"{len(self.healthy())} of {len(self.replicas)} replicas in rotation"

    async def check_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self._check(client, r) for r in self.replicas.values()))

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.check_all(client)
            await asyncio.sleep(self.interval)

    async def _check(self, client: httpx.AsyncClient, replica: Replica) -> None:
        try:
            health = await client.get(f"{replica.url}/health", timeout=self.timeout)
            if health.status_code != 200:
                self.mark_down(replica, f"/health answered {health.status_code}")
                return
            # With --api-key the client sends it (app.py); a replica's /metrics needs it.
            metrics = await client.get(f"{replica.url}/metrics", timeout=self.timeout)
            if metrics.status_code != 401:
                metrics.raise_for_status()
        except httpx.HTTPError as e:
            self.mark_down(replica, f"health check failed: {e!r}")
            return
        if metrics.status_code == 401:  # healthy, but its load is behind a key we lack
            if replica.url not in self._unscraped:
                self._unscraped.add(replica.url)
                logger.warning(
                    "replica %s wants an API key on /metrics: its load is unknown to the "
                    "router (give the router the key, or the replica --metrics-without-api-key)",
                    replica.url,
                )
        else:
            replica.waiting, replica.kv_usage = load_from_metrics(metrics.text)
        if not replica.healthy:
            replica.healthy = True
            logger.info("replica %s is healthy: in rotation (%s)", replica.url, self.capacity())


def load_from_metrics(text: str) -> tuple[float, float]:
    """(waiting requests, KV-cache usage) from a replica's Prometheus text."""
    values = {WAITING: 0.0, KV_USAGE: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values[WAITING], values[KV_USAGE]
