"""The router's health checks of replicas whose /metrics needs their --api-key (it does once
they have one): scraped with the key when the router has it; without it (`tokenmill router`
with no --api-key in front of keyed servers) a replica stays in rotation (its /health passed),
its load unknown, and the log says why once."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from tokenmill.entrypoints.router.app import build_router_app
from tokenmill.entrypoints.router.balancing.policies import make_policy
from tokenmill.entrypoints.router.balancing.replicas import ReplicaSet
from tokenmill.entrypoints.router.guard import OPEN_PATHS
from tokenmill.entrypoints.router.metrics import RouterMetrics, aggregated_metrics

KEY = "sk-replica"
URL = "http://replica:8000"
METRICS = 'tokenmill:num_requests_waiting{model_name="m"} 3.0\n'


def keyed_replica(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/health":
        return httpx.Response(200)
    if request.headers.get("authorization") != f"Bearer {KEY}":
        return httpx.Response(401, json={"error": {"code": "invalid_api_key"}})
    return httpx.Response(200, text=METRICS)


def check(replicas: ReplicaSet, key: str | None = None) -> str:
    """One round of health checks and an aggregated scrape, by a client that sends `key` on
    every request, as the router's does (router/app.py)."""
    headers = {"Authorization": f"Bearer {key}"} if key else None
    transport = httpx.MockTransport(keyed_replica)

    async def run() -> str:
        async with httpx.AsyncClient(transport=transport, headers=headers) as client:
            await replicas.check_all(client)
            return (await aggregated_metrics(RouterMetrics(replicas), client, replicas)).decode()

    return asyncio.run(run())


def test_the_router_scrapes_keyed_replicas_with_the_key() -> None:
    replicas = ReplicaSet([URL])
    text = check(replicas, KEY)
    replica = replicas.replicas[URL]
    assert replica.healthy and replica.waiting == 3.0
    assert f'tokenmill:num_requests_waiting{{model_name="m",replica="{URL}"}} 3.0' in text


def test_without_the_key_a_keyed_replica_stays_in_rotation_and_the_log_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    replicas = ReplicaSet([URL])
    with caplog.at_level(logging.WARNING, logger="tokenmill.router"):
        check(replicas)
        check(replicas)
    assert replicas.replicas[URL].healthy and replicas.replicas[URL].waiting == 0.0
    warnings = [r.getMessage() for r in caplog.records if "wants an API key" in r.getMessage()]
    assert len(warnings) == 1 and URL in warnings[0]


def test_the_routers_metrics_need_its_key_as_a_servers_do() -> None:
    """The router's /metrics carries every replica's prefix-cache counters."""
    app = build_router_app(ReplicaSet([URL]), make_policy("round-robin", 0, 0), api_key=KEY)

    async def get(path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)  # no lifespan: nothing reaches a replica
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            return await client.get(path)

    refused = asyncio.run(get("/metrics"))
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert "/metrics" not in OPEN_PATHS and {"/health", "/version"} <= OPEN_PATHS
