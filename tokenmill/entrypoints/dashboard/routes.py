"""The dashboard's routes: the page, its two assets, and its server-sent event stream.

With `--api-key` every route needs the key, like `/v1`: as a bearer token (curl, scripts) or
as the password of HTTP basic auth, which a browser asks for itself on the 401, so the key
never appears in a URL or the page.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import AsyncIterator, Callable
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from tokenmill.entrypoints.dashboard.feed import UPDATES_PER_SECOND, DashboardFeed
from tokenmill.entrypoints.http.context import ServerContext
from tokenmill.entrypoints.http.transport.api_keys import ApiKeys
from tokenmill.entrypoints.http.transport.streaming import EventStreamResponse

ASSETS = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
_UNAUTHORIZED_HEADERS = {"WWW-Authenticate": 'Basic realm="tokenmill dashboard"'}


def dashboard_router(ctx: ServerContext, keys: ApiKeys) -> APIRouter:
    router = APIRouter(dependencies=[Depends(_key_check(keys))], include_in_schema=False)

    # GET and HEAD (a HEAD is the GET without its body: uvicorn drops it).
    @router.api_route("/dashboard", methods=["GET", "HEAD"])
    async def page() -> Response:
        return _asset("dashboard.html")

    @router.api_route("/dashboard/assets/{name}", methods=["GET", "HEAD"])
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise HTTPException(404)
        return _asset(name)

    @router.get("/dashboard/events")
    async def events() -> Response:
        feed = DashboardFeed(ctx.engine, ctx.model_name, ctx.slos)
        return EventStreamResponse(_event_stream(ctx, feed))

    return router


async def _event_stream(ctx: ServerContext, feed: DashboardFeed) -> AsyncIterator[str]:
    """`setup` once, then `update` every quarter second until the server starts shutting
    down (an endless stream would otherwise hold the graceful shutdown for its whole timeout)."""
    yield _event("setup", feed.setup())
    while not ctx.stopping:
        yield _event("update", feed.update())
        await asyncio.sleep(1 / UPDATES_PER_SECOND)


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _asset(name: str) -> Response:
    content = resources.files("tokenmill.entrypoints.dashboard").joinpath("static", name)
    return Response(
        content.read_bytes(), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"}
    )


def _key_check(keys: ApiKeys) -> Callable[[Request], None]:
    def check(request: Request) -> None:
        if not keys:
            return
        given = _given_key(request.headers.get("authorization", ""))
        if keys.match(given) is None:
            raise HTTPException(
                401,
                "The dashboard needs the server's --api-key: as a bearer token, or as the "
                "password of HTTP basic auth (any user name).",
                headers=_UNAUTHORIZED_HEADERS,
            )

    return check


def _given_key(authorization: str) -> str:
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return ""
        return decoded.partition(":")[2]
    return ""
