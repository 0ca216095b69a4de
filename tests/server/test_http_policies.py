"""What the app answers before any route runs or besides the routes' own work: which routes
need the key (/metrics among them), no CDN-loading doc pages, `nosniff` on every response,
503 once shutdown has begun, 413 with its code, HEAD on the dashboard. In process: the engine
never starts (no lifespan), so these need no server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter
from server_utils import API_KEY

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.openai.app import build_app
from tokenmill.entrypoints.openai.context import ServerContext

KEYED = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def context(model_dir: Path) -> Iterator[ServerContext]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=128))
    yield ServerContext(AsyncEngine(engine, log_stats_interval=None), ["m"], "here")
    engine.shutdown()


def registry_with_a_counter() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("tokenmill:prefix_cache_hits", "hits", registry=registry).inc(240)
    return registry


def ask(app: FastAPI, method: str, path: str, **kwargs: Any) -> httpx.Response:
    async def request() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(request())


def test_metrics_need_the_key_when_the_server_has_one(context: ServerContext) -> None:
    """/metrics' prefix-cache counters move with other clients' prompts (a side channel that
    --enable-prompt-tokens-details keeps closed for cached_tokens)."""
    app = build_app(context, registry_with_a_counter(), API_KEY)
    refused = ask(app, "GET", "/metrics")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert "prefix_cache_hits" not in refused.text
    assert ask(app, "HEAD", "/metrics").status_code == 401
    keyed = ask(app, "GET", "/metrics", headers=KEYED)
    assert keyed.status_code == 200 and "tokenmill:prefix_cache_hits_total 240.0" in keyed.text


def test_metrics_can_be_left_open_for_scrapers_without_a_key(context: ServerContext) -> None:
    app = build_app(context, registry_with_a_counter(), API_KEY, metrics_without_api_key=True)
    assert ask(app, "GET", "/metrics").status_code == 200
    assert ask(app, "GET", "/v1/models").status_code == 401  # only /metrics is opened


def test_metrics_are_open_on_a_server_without_a_key(context: ServerContext) -> None:
    assert ask(build_app(context, CollectorRegistry(), None), "GET", "/metrics").status_code == 200


def test_no_doc_pages_that_load_scripts_from_a_cdn(context: ServerContext) -> None:
    """FastAPI's /docs and /redoc load unpinned CDN scripts without integrity hashes."""
    app = build_app(context, CollectorRegistry(), API_KEY)
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert ask(app, "GET", path).status_code == 404, path
    document = ask(app, "GET", "/openapi.json")
    assert document.status_code == 200 and document.json()["info"]["title"] == "tokenmill"


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        ("GET", "/version", {}, 200),
        ("GET", "/openapi.json", {}, 200),
        ("GET", "/v1/models", {}, 401),
        ("GET", "/v1/models", KEYED, 200),
        ("GET", "/nope", KEYED, 404),
        ("GET", "/dashboard", KEYED, 200),
        ("GET", "/dashboard/assets/dashboard.js", KEYED, 200),
        ("POST", "/tokenize", KEYED, 400),
    ],
)
def test_every_response_says_nosniff(
    context: ServerContext, method: str, path: str, headers: dict[str, str], status: int
) -> None:
    app = build_app(context, CollectorRegistry(), API_KEY)
    response = ask(app, method, path, headers=headers, content=b"{" if method == "POST" else None)
    assert response.status_code == status
    assert response.headers["X-Content-Type-Options"] == "nosniff"


def test_requests_after_shutdown_began_are_503_and_close_the_connection(
    context: ServerContext,
) -> None:
    """Kept-alive connections used to get 200s during the shutdown's error flush."""
    app = build_app(context, CollectorRegistry(), API_KEY)
    assert ask(app, "GET", "/version").status_code == 200
    context.stopping = True
    try:
        for path in ("/version", "/v1/models", "/health"):
            refused = ask(app, "GET", path, headers=KEYED)
            assert refused.status_code == 503, path
            assert refused.json()["error"]["code"] == "server_shutting_down"
            assert refused.headers["connection"] == "close"
    finally:
        context.stopping = False


def test_a_chunked_body_over_the_limit_is_413_with_its_code(context: ServerContext) -> None:
    app = build_app(context, CollectorRegistry(), API_KEY, max_body_bytes=1000)
    body = b'{"prompt": "' + b"x" * 5000 + b'"}'

    async def chunks():  # no Content-Length: counted while read
        for start in range(0, len(body), 512):
            yield body[start : start + 512]

    headers = {**KEYED, "Content-Type": "application/json"}
    declared = ask(app, "POST", "/tokenize", headers=headers, content=body)
    streamed = ask(app, "POST", "/tokenize", headers=headers, content=chunks())
    assert "content-length" not in {k.lower() for k in streamed.request.headers}
    for response in (declared, streamed):
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "request_too_large"
        assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/dashboard", "/dashboard/assets/dashboard.css"])
def test_head_on_the_dashboard_answers_like_get(context: ServerContext, path: str) -> None:
    app = build_app(context, CollectorRegistry(), API_KEY)
    head, get = ask(app, "HEAD", path, headers=KEYED), ask(app, "GET", path, headers=KEYED)
    assert head.status_code == get.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]
    assert ask(app, "HEAD", path).status_code == 401
