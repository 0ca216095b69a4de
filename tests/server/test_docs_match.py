"""docs/server.md and docs/metrics.md say what the server does: the routes open without the API
key, and the metric families /metrics exports."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
from fastapi.routing import iter_route_contexts
from prometheus_client import CollectorRegistry
from server_utils import API_KEY

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.http.app import build_app
from tokenmill.entrypoints.http.context import ServerContext

DOCS = Path(__file__).parents[2] / "docs"
# Families registered only with a flag (docs/metrics.md says which): absent from a default server.
CONDITIONAL_METRICS = re.compile(r"tokenmill:(spec_decode_|itl_|kv_connector_|kv_transfer_)")


def documented_open_routes() -> set[str]:
    """The paths in docs/server.md's sentence "The open routes are ..., for probes"."""
    text = " ".join(DOCS.joinpath("server.md").read_text().split())
    match = re.search(r"The open routes are (.*?), for probes", text)
    assert match, "docs/server.md no longer lists the open routes"
    return set(re.findall(r"`(/[^`]*)`", match.group(1)))


def test_the_routes_open_without_the_key_are_the_documented_ones(model_dir: Path) -> None:
    """Every route the app has, asked without the key: those that do not answer 401 are open,
    and must be exactly the ones docs/server.md lists."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=128))
    ctx = ServerContext(AsyncEngine(engine, log_stats_interval=None), ["m"], "here")
    app = build_app(ctx, CollectorRegistry(), API_KEY)  # the engine never starts: no lifespan
    requests = [  # included routers' routes too, with their prefixes
        (method, route.path.replace("{model_id:path}", "m").replace("{name}", "app.js"))
        for route in iter_route_contexts(app.routes)
        if route.path is not None
        for method in sorted(route.methods or ())
    ]
    assert ("POST", "/reset_prefix_cache") in requests

    async def open_paths() -> set[str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            statuses = {
                (method, path): (await client.request(method, path, json={})).status_code
                for method, path in requests
            }
        return {path for (_, path), status in statuses.items() if status != 401}

    try:
        assert asyncio.run(open_paths()) == documented_open_routes()
    finally:
        engine.shutdown()


def exported_metric_names(text: str) -> set[str]:
    """Family names as docs/metrics.md writes them: histograms without their `_bucket`,
    `_count` and `_sum` samples, counters with `_total`; prometheus-client's `_created`
    samples and the process collector's `process_*` left out."""
    names = set()
    for line in text.splitlines():
        if line.startswith("tokenmill:"):
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            if not name.endswith("_created"):
                names.add(re.sub(r"_(bucket|count|sum)$", "", name))
    return names


def documented_metric_names() -> set[str]:
    """The first column of docs/metrics.md's tables, labels dropped."""
    rows = re.findall(r"^\| `(tokenmill:\w+)", DOCS.joinpath("metrics.md").read_text(), re.M)
    assert rows, "docs/metrics.md has no metric tables"
    return set(rows)


def test_metrics_md_lists_exactly_the_exported_families(http: httpx.Client) -> None:
    exported = exported_metric_names(http.get("/metrics").text)
    documented = documented_metric_names()
    assert exported == {n for n in documented if not CONDITIONAL_METRICS.match(n)}
    assert not any(CONDITIONAL_METRICS.match(name) for name in exported)
