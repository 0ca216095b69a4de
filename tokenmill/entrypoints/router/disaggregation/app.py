"""`tokenmill router --prefill URL --decode URL`: the router's app in front of prefill and
decode instances (split_proxy.py). Generation requests are split between the two; everything
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

from tokenmill.entrypoints.http.transport.api_keys import ApiKeys
from tokenmill.entrypoints.router.app import (
    DEFAULT_MAX_BODY_BYTES,
    METHODS,
    ROUTED_PATHS,
    Proxy,
    _error,
    _guard_error,
    replica_client,
)
from tokenmill.entrypoints.router.balancing.policies import Policy
from tokenmill.entrypoints.router.balancing.prefix_key import DEFAULT_PREFIX_CHARS
from tokenmill.entrypoints.router.balancing.replicas import ReplicaSet
from tokenmill.entrypoints.router.disaggregation.split_proxy import DisaggProxy
from tokenmill.entrypoints.router.guard import GuardError, check_api_key
from tokenmill.entrypoints.router.metrics import RouterMetrics, aggregated_metrics


def build_disagg_app(
    prefill: ReplicaSet,
    decode: ReplicaSet,
    policies: tuple[Policy, Policy],
    prefix_chars: int = DEFAULT_PREFIX_CHARS,
    api_key: ApiKeys | str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics_without_api_key: bool = False,
) -> FastAPI:
    keys = ApiKeys.of(api_key)
    metrics = RouterMetrics(prefill, decode)
    proxies = [
        Proxy(replicas, policy, prefix_chars, keys, max_body_bytes, metrics)
        for replicas, policy in zip((prefill, decode), policies)
    ]
    routes = _Routes(prefill, decode, proxies, ApiKeys() if metrics_without_api_key else keys)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with replica_client(keys.first) as client:
            for proxy in proxies:
                proxy.client = client
            await asyncio.gather(prefill.check_all(client), decode.check_all(client))
            checkers = [asyncio.create_task(s.run(client)) for s in (prefill, decode)]
            yield
            for checker in checkers:
                checker.cancel()

    app = FastAPI(title="tokenmill router (prefill/decode)", lifespan=lifespan, openapi_url=None)
    app.add_api_route("/health", routes.health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", routes.metrics_text, methods=["GET", "HEAD"])
    app.add_api_route("/reset_prefix_cache", routes.reset_prefix_cache, methods=["POST"])
    for path in ROUTED_PATHS:
        app.add_api_route(path, routes.generate, methods=["POST"])
    app.add_api_route("/{path:path}", proxies[1].forward, methods=METHODS)
    return app


class _Routes:
    """The routes of the router's own (the rest are the proxies')."""

    def __init__(
        self,
        prefill: ReplicaSet,
        decode: ReplicaSet,
        proxies: list[Proxy],
        metrics_key: ApiKeys,
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self.proxies = proxies
        self.disagg = DisaggProxy(*proxies)
        self.metrics_key = metrics_key  # the keys /metrics takes (none: open)

    async def health(self) -> Response:
        counts = {
            "healthy_prefill": len(self.prefill.healthy()),
            "prefill": len(self.prefill.replicas),
            "healthy_decode": len(self.decode.healthy()),
            "decode": len(self.decode.replicas),
        }
        if counts["healthy_decode"]:
            return JSONResponse(counts)
        message = f"no decode instance is healthy (0 of {counts['decode']})"
        return _error(503, message, "no_healthy_replica")

    async def metrics_text(self, request: Request) -> Response:
        try:
            check_api_key(request, self.metrics_key, "/metrics")
        except GuardError as e:
            return _guard_error(e)
        decode = self.proxies[1]
        text = await aggregated_metrics(decode.metrics, decode.client, self.prefill, self.decode)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def reset_prefix_cache(self, request: Request) -> Response:
        for proxy in self.proxies:
            answer = await proxy.reset_prefix_cache(request)
            if answer.status_code != 200:
                return answer
        return Response(status_code=200)

    async def generate(self, request: Request) -> Response:
        return await self.disagg.generate(request, request.url.path)
