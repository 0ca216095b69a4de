"""`tokenmill router --prefill URL --decode URL`: the router's app in front of prefill and
decode instances (disagg.py). Generation requests are split between the two; everything
else (`/v1/models`, `/tokenize`, ...) goes to a decode instance, `/reset_prefix_cache` to
every instance. `/health` is 200 while a decode instance is healthy (without a prefill
instance the decode instances serve requests whole); `/metrics` has the router's counters
and every instance's metrics labelled `replica`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.router.app import (
    DEFAULT_MAX_BODY_BYTES,
    METHODS,
    ROUTED_PATHS,
    Proxy,
    _error,
    _guard_error,
    replica_client,
)
from tokenmill.entrypoints.router.disagg import DisaggProxy
from tokenmill.entrypoints.router.guard import GuardError, check_api_key
from tokenmill.entrypoints.router.metrics import RouterMetrics, aggregated_metrics
from tokenmill.entrypoints.router.policies import Policy
from tokenmill.entrypoints.router.prefix_key import DEFAULT_PREFIX_CHARS
from tokenmill.entrypoints.router.replicas import ReplicaSet


def build_disagg_app(
    prefill: ReplicaSet,
    decode: ReplicaSet,
    policies: tuple[Policy, Policy],
    prefix_chars: int = DEFAULT_PREFIX_CHARS,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics_without_api_key: bool = False,
) -> FastAPI:
    metrics = RouterMetrics(prefill, decode)
    proxies = [
        Proxy(replicas, policy, prefix_chars, api_key, max_body_bytes, metrics)
        for replicas, policy in zip((prefill, decode), policies)
    ]
    disagg = DisaggProxy(*proxies)
    metrics_key = None if metrics_without_api_key else api_key

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with replica_client(api_key) as client:
            for proxy in proxies:
                proxy.client = client
            await asyncio.gather(prefill.check_all(client), decode.check_all(client))
            checkers = [asyncio.create_task(s.run(client)) for s in (prefill, decode)]
            yield
            for checker in checkers:
                checker.cancel()

    async def health() -> Response:
        counts = {
            "healthy_prefill": len(prefill.healthy()),
            "prefill": len(prefill.replicas),
            "healthy_decode": len(decode.healthy()),
            "decode": len(decode.replicas),
        }
        if counts["healthy_decode"]:
            return JSONResponse(counts)
        message = f"no decode instance is healthy (0 of {counts['decode']})"
        return _error(503, message, "no_healthy_replica")

    async def metrics_text(request: Request) -> Response:
        try:
            check_api_key(request, metrics_key, "/metrics")
        except GuardError as e:
            return _guard_error(e)
        text = await aggregated_metrics(metrics, proxies[1].client, prefill, decode)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def reset_prefix_cache(request: Request) -> Response:
        for proxy in proxies:
            answer = await proxy.reset_prefix_cache(request)
            if answer.status_code != 200:
                return answer
        return Response(status_code=200)

    async def generate(request: Request) -> Response:
        return await disagg.generate(request, request.url.path)

    app = FastAPI(title="tokenmill router (prefill/decode)", lifespan=lifespan, openapi_url=None)
    app.add_api_route("/health", health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", metrics_text, methods=["GET", "HEAD"])
    app.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])
    for path in ROUTED_PATHS:
        app.add_api_route(path, generate, methods=["POST"])
    app.add_api_route("/{path:path}", proxies[1].forward, methods=METHODS)
    return app
