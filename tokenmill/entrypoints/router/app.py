"""The router's HTTP front: an OpenAI-compatible app that forwards every request to one
replica chosen by the routing policy.

Completions and chat completions are routed by the policy (prefix-aware reads the prompt);
everything else (`/v1/models`, `/tokenize`, ...) goes to any healthy replica, except
`/health` and `/metrics` (the router's own), `/reset_prefix_cache` (sent to all), and a
request for a stored response (`previous_response_id`, GET or DELETE /v1/responses/{id}),
sent to the replica that stored it (response_affinity.py; to any replica, which answers 404,
when that one is gone).
Before a body is read the router checks the API key (`--api-key`, repeatable, and
`--api-key-file`; every route but the open ones a server has), then reads the body up to
`--max-request-body-bytes` (413 past it); headers pass through both ways (the `Authorization`
header included: each replica checks it again, and keeps a client's stored responses to its
key). A client that disconnects before its answer closes the router's request to the
replica, which aborts it, streaming or not. A server-sent-event stream is passed through
chunk by chunk as the replica writes it; if the replica dies mid-stream the client gets an
OpenAI error event and `[DONE]`, a non-streaming request a 502. A replica that refuses the
connection is taken out of rotation and the request, not yet sent, goes to another one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.entrypoints.http.responses.ids import REPLICA_TAG_HEADER
from tokenmill.entrypoints.http.transport.api_keys import ApiKeys
from tokenmill.entrypoints.router.balancing.policies import Policy
from tokenmill.entrypoints.router.balancing.prefix_key import DEFAULT_PREFIX_CHARS, prefix_key
from tokenmill.entrypoints.router.balancing.replicas import Replica, ReplicaSet
from tokenmill.entrypoints.router.balancing.response_affinity import stored_response_tag
from tokenmill.entrypoints.router.guard import (
    ClientGone,
    GuardError,
    check_api_key,
    read_body,
    unless_disconnected,
)
from tokenmill.entrypoints.router.metrics import RouterMetrics, aggregated_metrics

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
# Hop-by-hop headers, and those the proxy recomputes, are not passed on.
DROP_REQUEST_HEADERS = {
    "host", "content-length", "connection", "keep-alive", "accept-encoding",
    REPLICA_TAG_HEADER,  # the router's to set
}  # fmt: skip
DROP_RESPONSE_HEADERS = {
    "content-length", "connection", "keep-alive", "transfer-encoding", "date", "server",
}  # fmt: skip
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]
DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024  # as `tokenmill serve`'s
# The decision label of a request sent to the replica holding the response it names.
STORED_RESPONSE = "stored_response"
# The status a request whose client has gone is logged with (nobody reads it), as nginx's.
CLIENT_CLOSED_REQUEST = 499


def build_router_app(
    replicas: ReplicaSet,
    policy: Policy,
    prefix_chars: int = DEFAULT_PREFIX_CHARS,
    api_key: ApiKeys | str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics_without_api_key: bool = False,
) -> FastAPI:
    """`api_key`: the keys clients may send (a string is one; None or none: open)."""
    keys = ApiKeys.of(api_key)
    proxy = Proxy(replicas, policy, prefix_chars, keys, max_body_bytes)
    proxy.metrics_api_key = ApiKeys() if metrics_without_api_key else keys

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with replica_client(keys.first) as client:
            proxy.client = client
            await replicas.check_all(client)
            checker = asyncio.create_task(replicas.run(client))
            yield
            checker.cancel()

    app = FastAPI(title="tokenmill router", lifespan=lifespan, openapi_url=None)
    app.add_api_route("/health", proxy.health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", proxy.metrics_text, methods=["GET", "HEAD"])
    app.add_api_route("/reset_prefix_cache", proxy.reset_prefix_cache, methods=["POST"])
    app.add_api_route("/{path:path}", proxy.forward, methods=METHODS)
    return app


def replica_client(api_key: str | None) -> httpx.AsyncClient:
    """The router's client to its replicas; the key goes on its own requests too (health
    checks, /metrics scrapes)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers)


class Proxy:
    """The routes' work; `client` is set by the app's lifespan."""

    def __init__(
        self,
        replicas: ReplicaSet,
        policy: Policy,
        prefix_chars: int,
        api_key: ApiKeys,
        max_body_bytes: int,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.replicas = replicas
        self.policy = policy
        self.prefix_chars = prefix_chars
        self.api_key = api_key
        self.metrics_api_key = api_key  # the keys /metrics takes (none: open)
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics or RouterMetrics(replicas)
        self.client: httpx.AsyncClient

    async def health(self) -> Response:
        """200 while any replica is in rotation, with how many are (reduced capacity is
        still service: a load balancer should not drop the whole deployment for it)."""
        healthy, total = len(self.replicas.healthy()), len(self.replicas.replicas)
        if healthy:
            return JSONResponse({"healthy_replicas": healthy, "replicas": total})
        return _error(503, f"no replica is healthy (0 of {total})", "no_healthy_replica")

    async def metrics_text(self, request: Request) -> Response:
        try:
            check_api_key(request, self.metrics_api_key, "/metrics")
        except GuardError as e:
            return _guard_error(e)
        text = await aggregated_metrics(self.metrics, self.client, self.replicas)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def reset_prefix_cache(self, request: Request) -> Response:
        """Sent to every healthy replica; the first failure is the answer."""
        try:
            check_api_key(request, self.api_key, "/reset_prefix_cache")
        except GuardError as e:
            return _guard_error(e)
        headers = _forward_headers(request)
        answers = await asyncio.gather(
            *(self.client.post(f"{r.url}/reset_prefix_cache", headers=headers)
              for r in self.replicas.healthy()),
            return_exceptions=True,
        )  # fmt: skip
        for answer in answers:
            if isinstance(answer, httpx.Response) and answer.status_code != 200:
                return _passthrough(answer, answer.content)
            if isinstance(answer, BaseException):
                return _error(502, f"a replica failed to reset: {answer!r}", "replica_failed")
        return Response(status_code=200)

    async def forward(self, request: Request, path: str) -> Response:
        path = "/" + path
        try:
            body = await self.checked_body(request, path)
        except GuardError as e:
            return _guard_error(e)
        return await self.send_body(request, path, body)

    async def checked_body(self, request: Request, path: str) -> bytes:
        """The request's body once its key is checked (first: no body is read without it);
        GuardError otherwise."""
        check_api_key(request, self.api_key, path)
        return await read_body(request, self.max_body_bytes)

    async def send_body(self, request: Request, path: str, body: bytes) -> Response:
        """Send `body` to a replica the policy picks; its answer, relayed."""
        key = prefix_key(path, body, self.prefix_chars) if path in ROUTED_PATHS else None
        owner = stored_response_tag(request.method, path, body)
        try:
            # A non-streaming replica sends its headers only once it has the whole answer.
            sent = await unless_disconnected(request, self._send(request, path, body, key, owner))
        except _ReplicaFailed as e:
            return _error(502, str(e), "replica_failed")
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if sent is None:
            return _error(503, "no replica is healthy", "no_healthy_replica")
        replica, upstream = sent
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(
                self._relay(replica, upstream),
                status_code=upstream.status_code,
                headers=dict(_response_headers(upstream)),
            )
        try:
            content = await unless_disconnected(request, upstream.aread())
        except httpx.HTTPError as e:
            self._failed(replica, "request", e)
            return _error(502, _failure_message(replica, e), "replica_failed")
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        finally:
            await upstream.aclose()
            replica.in_flight -= 1
        return _passthrough(upstream, content)

    async def _send(
        self,
        request: Request,
        path: str,
        body: bytes,
        key: bytes | None,
        owner: str | None = None,
        avoid: str | None = None,
    ) -> tuple[Replica, httpx.Response] | None:
        """Choose a replica (the healthy one tagged `owner` if there is one; not `avoid` while
        another is healthy) and send; a refused connection takes the replica out and tries the
        next (the request was never sent). Returns with the replica's count raised; None when
        no replica is healthy."""
        tried: set[str] = set()
        if avoid is not None and any(r.url != avoid for r in self.replicas.healthy()):
            tried.add(avoid)
        while candidates := [r for r in self.replicas.healthy() if r.url not in tried]:
            stored_on = [r for r in candidates if r.tag == owner]
            if stored_on:
                replica, reason = stored_on[0], STORED_RESPONSE
            else:
                decision = self.policy.choose([r.load() for r in candidates], key)
                replica, reason = self.replicas.replicas[decision.replica], decision.reason
            upstream_request = self.client.build_request(
                request.method,
                replica.url + path,
                params=request.url.query,
                headers=[*_forward_headers(request), (REPLICA_TAG_HEADER, replica.tag)],
                content=body,
            )
            replica.in_flight += 1
            try:
                upstream = await self.client.send(upstream_request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                replica.in_flight -= 1
                self.metrics.failures.labels(replica.url, "connect").inc()
                self.replicas.mark_down(replica, f"connection failed: {e!r}")
                tried.add(replica.url)
                continue
            except httpx.HTTPError as e:
                replica.in_flight -= 1
                self._failed(replica, "request", e)
                raise _ReplicaFailed(_failure_message(replica, e)) from e
            except BaseException:  # cancelled: the client has gone
                replica.in_flight -= 1
                raise
            self.metrics.requests.labels(replica.url, reason).inc()
            return replica, upstream
        return None

    async def _relay(self, replica: Replica, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """The replica's stream, chunk by chunk; an error event and [DONE] if it breaks."""
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            self._failed(replica, "stream", e)
            error = _error_body(_failure_message(replica, e), "replica_failed")
            yield f"\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await upstream.aclose()
            replica.in_flight -= 1

    def _failed(self, replica: Replica, stage: str, error: Exception) -> None:
        self.metrics.failures.labels(replica.url, stage).inc()
        self.replicas.mark_down(replica, f"failed during a {stage}: {error!r}")


class _ReplicaFailed(Exception):
    pass


def _failure_message(replica: Replica, error: Exception) -> str:
    return (
        f"the replica {replica.url} serving this request failed ({type(error).__name__}); "
        "it has been taken out of rotation, retry the request"
    )


def _forward_headers(request: Request) -> list[tuple[str, str]]:
    return [(k, v) for k, v in request.headers.items() if k.lower() not in DROP_REQUEST_HEADERS]


def _response_headers(upstream: httpx.Response) -> list[tuple[str, str]]:
    return [
        (k, v) for k, v in upstream.headers.multi_items() if k.lower() not in DROP_RESPONSE_HEADERS
    ]


def _passthrough(upstream: httpx.Response, content: bytes) -> Response:
    response = Response(content, status_code=upstream.status_code)
    for k, v in _response_headers(upstream):
        response.headers.append(k, v)
    return response


def _error_body(message: str, code: str, type: str = "server_error") -> dict[str, object]:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def _guard_error(error: GuardError) -> JSONResponse:
    body = _error_body(str(error), error.code, "invalid_request_error")
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(_error_body(message, code), status_code=status)
