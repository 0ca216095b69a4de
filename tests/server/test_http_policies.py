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
from tokenmill.entrypoints.http.app import build_app
from tokenmill.entrypoints.http.context import ServerContext
from tokenmill.entrypoints.http.transport.api_keys import ApiKeys

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


def test_stored_responses_belong_to_the_key_that_stored_them(context: ServerContext) -> None:
    """Several keys, each a client of its own: another key's response is a 404, as OpenAI's."""
    other = "sk-another-client"
    app = build_app(context, CollectorRegistry(), ApiKeys((API_KEY, other)))
    app.state.response_store.put({"id": "resp_1", "object": "response"}, [], owner=API_KEY)
    theirs = {"Authorization": f"Bearer {other}"}
    assert ask(app, "GET", "/v1/responses/resp_1", headers=theirs).status_code == 404
    assert ask(app, "DELETE", "/v1/responses/resp_1", headers=theirs).status_code == 404
    body = {"model": "m", "input": "hi", "previous_response_id": "resp_1"}
    chained = ask(app, "POST", "/v1/responses", json=body, headers=theirs)
    assert chained.status_code == 404
    assert chained.json()["error"]["param"] == "previous_response_id"
    assert ask(app, "GET", "/v1/responses/resp_1", headers=KEYED).json()["id"] == "resp_1"
    assert ask(app, "DELETE", "/v1/responses/resp_1", headers=KEYED).status_code == 200


@pytest.mark.parametrize(
    ("metadata", "limit"),
    [
        ({f"k{i}": "v" for i in range(17)}, "at most 16"),
        ({"k" * 65: "v"}, "at most 64"),
        ({"k": "v" * 513}, "at most 512"),
    ],
)
def test_metadata_past_openais_limits_is_a_400(
    context: ServerContext, metadata: dict[str, str], limit: str
) -> None:
    app = build_app(context, CollectorRegistry(), API_KEY)
    body = {"model": "m", "input": "hi", "metadata": metadata}
    refused = ask(app, "POST", "/v1/responses", json=body, headers=KEYED)
    assert refused.status_code == 400, refused.text
    assert limit in refused.json()["error"]["message"]


def test_the_response_store_is_capped_in_bytes_and_counts_evictions(
    context: ServerContext,
) -> None:
    registry = CollectorRegistry()
    app = build_app(context, registry, API_KEY, responses_store_max_bytes=20_000)
    store = app.state.response_store
    for i in range(10):
        store.put({"id": f"resp_{i}", "text": "x" * 5_000}, [], owner=API_KEY)
    assert store.num_bytes <= 20_000 and store.get("resp_9", API_KEY) is not None
    text = ask(app, "GET", "/metrics", headers=KEYED).text
    evicted = 'tokenmill:responses_store_evictions_total{model_name="m",reason="bytes"}'
    assert f"{evicted} {10 - len(store)}.0" in text
    assert "tokenmill:responses_store_bytes" in text
