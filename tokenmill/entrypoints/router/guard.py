"""What the router checks before it holds a request's body or sends it on: the API key, then
the body's size, then (while the replica works) that the client is still there.

Its own, light version of the server's checks (`http/transport/body_limit.py`, the `/v1` key check):
those build their errors from `http/transport/errors.py`, which loads the engine (torch) that the
router process does not otherwise import. Codes and messages match the server's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from tokenmill.entrypoints.http.transport.api_keys import ApiKeys

T = TypeVar("T")

# Routes that answer without a key, as a server's do (GET or HEAD only; the rest need it).
# Keep in step with the server's: a route keyed there is keyed here.
# (/metrics is keyed: a server's prefix-cache counters tell one client about another's
# prompts, and the router's carries every replica's; --metrics-without-api-key opens it.)
OPEN_PATHS = frozenset({"/health", "/version", "/openapi.json"})


class GuardError(Exception):
    """A request refused before it reached a replica: its status, message and code."""

    def __init__(self, status: int, message: str, code: str, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.headers = headers


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def check_api_key(request: Request, keys: ApiKeys, path: str) -> None:
    """Raises `GuardError` (401) unless the request may pass: no key configured, an open
    route, or the bearer token equal to one of the keys (compared in constant time). The
    client's own header goes on to the replica, which checks it again and scopes the
    responses it stores to it."""
    if not keys or (path in OPEN_PATHS and request.method in ("GET", "HEAD")):
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    given = token.strip() if scheme.lower() == "bearer" else ""
    if keys.match(given) is None:
        raise GuardError(
            401,
            "Incorrect API key provided. Pass the router's --api-key as a bearer token.",
            "invalid_api_key",
            {"WWW-Authenticate": "Bearer"},
        )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused (`GuardError` 413) as soon as it is known to exceed `max_bytes`: by
    its Content-Length before a byte is read, or (chunked) once it grows past the limit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client disconnects first, `work` is cancelled (so its
    connection to the replica closes and the replica aborts) and `ClientGone` is raised.
    Call once the body has been read: the next message is then the disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _too_large(max_bytes: int) -> GuardError:
    return GuardError(
        413,
        f"The request body is larger than this router's limit of {max_bytes} bytes "
        "(--max-request-body-bytes).",
        "request_too_large",
        {},
    )
