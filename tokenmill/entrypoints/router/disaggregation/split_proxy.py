"""Prefill/decode disaggregation in the router: each completion or chat request is run by a
prefill instance to one token (its KV held there), then by a decode instance that pulls that
KV (the P2P connector) and generates the answer, which goes back to the client as the decode
instance sends it, streamed or whole: the OpenAI API is unchanged for the client.

When the KV does not arrive (the prefill instance died mid-transfer, a timeout, a corrupted
block: the decode instance answers `kv_transfer_failed` before any token), the request is
sent once more through a fresh prefill instance (another one while one is healthy). With no
prefill instance healthy, the decode instance runs the whole request itself: slower for the
streams it is decoding, but served. Requests that cannot be split (a batch of prompts, prompt
logprobs) go to a decode instance whole.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import Counter, Histogram

from tokenmill.entrypoints.router.app import (
    CLIENT_CLOSED_REQUEST,
    Proxy,
    _error,
    _error_body,
    _failure_message,
    _guard_error,
    _passthrough,
    _ReplicaFailed,
    _response_headers,
)
from tokenmill.entrypoints.router.balancing.replicas import Replica
from tokenmill.entrypoints.router.disaggregation import leg_bodies as bodies
from tokenmill.entrypoints.router.guard import ClientGone, GuardError, unless_disconnected
from tokenmill.entrypoints.router.metrics import PREFIX

logger = logging.getLogger("tokenmill.router")

MAX_ATTEMPTS = 2  # a request whose KV did not arrive is prefilled once more
_PREFILL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class DisaggMetrics:
    def __init__(self, registry) -> None:
        self.requests = Counter(
            PREFIX + "disagg_requests",
            "Generation requests by how they were served: disaggregated (prefill instance, "
            "then decode instance), decode_only (whole on a decode instance: no prefill "
            "instance healthy, or a request that cannot be split)",
            ["mode"],
            registry=registry,
        )
        self.retries = Counter(
            PREFIX + "kv_transfer_retries",
            "Requests prefilled again because their KV did not reach the decode instance",
            registry=registry,
        )
        self.prefill_seconds = Histogram(
            PREFIX + "prefill_seconds",
            "Time of the prefill leg: sent to a prefill instance until its answer (its "
            "queue time and the prompt's prefill)",
            buckets=_PREFILL_BUCKETS,
            registry=registry,
        )


class DisaggProxy:
    """The generation routes of a disaggregating router; `prefill` and `decode` are the
    proxies of the two replica sets (they share one client and one metrics registry)."""

    def __init__(self, prefill: Proxy, decode: Proxy) -> None:
        self.prefill = prefill
        self.decode = decode
        self.metrics = DisaggMetrics(decode.metrics.registry)

    async def generate(self, request: Request, path: str) -> Response:
        try:
            raw = await self.decode.checked_body(request, path)
        except GuardError as e:
            return _guard_error(e)
        body = bodies.parse(raw)
        if body is None or not bodies.disaggregable(path, body):
            self.metrics.requests.labels("decode_only").inc()
            return await self.decode.send_body(request, path, raw)
        try:
            return await self._disaggregated(request, path, body)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def _disaggregated(self, request: Request, path: str, body: dict) -> Response:
        avoid: str | None = None
        for attempt in range(MAX_ATTEMPTS):
            prefill_url, params = await self._prefill(request, path, body, avoid)
            mode = "decode_only" if params is None else "disaggregated"
            answer = await self._decode(request, path, body, params)
            if not isinstance(answer, _KVNotArrived):
                self.metrics.requests.labels(mode).inc()
                return answer
            if attempt + 1 < MAX_ATTEMPTS:
                logger.warning("KV from %s did not arrive: prefilling again", prefill_url)
                self.metrics.retries.inc()
                avoid = prefill_url
        return answer.response

    async def _prefill(
        self, request: Request, path: str, body: dict, avoid: str | None
    ) -> tuple[str | None, dict | None]:
        """(the prefill instance, the KV's params); (None, None) when no prefill instance is
        healthy or the request was refused (the decode instance then runs it whole)."""
        leg = bodies.prefill_body(path, body)
        start = time.monotonic()
        while True:
            try:
                sent = await unless_disconnected(
                    request, self.prefill._send(request, path, leg, None, avoid=avoid)
                )
            except _ReplicaFailed:
                continue  # taken out of rotation: the next healthy one, if any
            if sent is None:
                logger.warning("no prefill instance is healthy: decoding with local prefill")
                return None, None
            replica, upstream = sent
            try:
                content = await unless_disconnected(request, upstream.aread())
            except httpx.HTTPError as e:
                self.prefill._failed(replica, "request", e)
                continue
            finally:
                await upstream.aclose()
                replica.in_flight -= 1
            if 400 <= upstream.status_code < 500:
                # Refused: the decode instance checks the client's own request and answers it
                # (the same error a single server gives, not one about the prefill leg's
                # rewrite), or serves it whole if only the rewrite was the problem.
                return None, None
            if upstream.status_code != 200:
                self.prefill.replicas.mark_down(replica, f"answered {upstream.status_code}")
                continue
            self.metrics.prefill_seconds.observe(time.monotonic() - start)
            answer = bodies.parse(content) or {}
            params = answer.get("kv_transfer_params")
            return replica.url, params if isinstance(params, dict) else None

    async def _decode(
        self, request: Request, path: str, body: dict, params: dict | None
    ) -> Response | _KVNotArrived:
        leg = bodies.decode_body(body, params)
        try:
            sent = await unless_disconnected(request, self.decode._send(request, path, leg, None))
        except _ReplicaFailed as e:
            return _error(502, str(e), "replica_failed")
        if sent is None:
            return _error(503, "no decode instance is healthy", "no_healthy_replica")
        replica, upstream = sent
        try:
            head, rest = await unless_disconnected(request, _first_event(upstream))
        except httpx.HTTPError as e:
            await _close(replica, upstream)
            self.decode._failed(replica, "request", e)
            return _error(502, _failure_message(replica, e), "replica_failed")
        except BaseException:
            await _close(replica, upstream)
            raise
        if bodies.kv_transfer_failed(upstream.status_code, head):
            await _close(replica, upstream)
            return _KVNotArrived(_passthrough(upstream, head))
        if rest is None:
            await _close(replica, upstream)
            return _passthrough(upstream, head)
        return StreamingResponse(
            self._relay(replica, upstream, head, rest),
            status_code=upstream.status_code,
            headers=dict(_response_headers(upstream)),
        )

    async def _relay(
        self,
        replica: Replica,
        upstream: httpx.Response,
        head: bytes,
        rest: AsyncIterator[bytes],
    ) -> AsyncIterator[bytes]:
        """The decode instance's stream: the event already read, then the rest as it
        comes; an error event and [DONE] if it breaks."""
        try:
            yield head
            async for chunk in rest:
                yield chunk
        except httpx.HTTPError as e:
            self.decode._failed(replica, "stream", e)
            error = _error_body(_failure_message(replica, e), "replica_failed")
            yield f"\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await _close(replica, upstream)


class _KVNotArrived:
    """The decode instance's answer that the KV did not arrive (sent if no retry is left)."""

    def __init__(self, response: Response) -> None:
        self.response = response


async def _first_event(upstream: httpx.Response) -> tuple[bytes, AsyncIterator[bytes] | None]:
    """A stream's first server-sent event (and the iterator over the rest), or a plain
    answer's whole body (and None): enough to tell a failed KV transfer from a token."""
    if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
        return await upstream.aread(), None
    chunks = upstream.aiter_raw()
    head = b""
    async for chunk in chunks:
        head += chunk
        if b"\n\n" in head:
            break
    return head, chunks


async def _close(replica: Replica, upstream: httpx.Response) -> None:
    await upstream.aclose()
    replica.in_flight -= 1
