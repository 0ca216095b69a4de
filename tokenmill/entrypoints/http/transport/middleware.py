"""Two small ASGI middlewares every response passes through: `X-Content-Type-Options:
nosniff` (a browser must not guess a type, e.g. run a JSON error as a script), and a 503 with
`Connection: close` for any request that arrives once shutdown has begun (on a keep-alive
connection, or during the error flush after the grace period): a draining server takes no new
work, and the client learns to go elsewhere."""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.entrypoints.http.transport.errors import SERVER_ERROR, OpenAIError, error_response


class NoSniff:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Content-Type-Options"] = "nosniff"
            await send(message)

        await self.app(scope, receive, send_with_header)


class RefuseWhileStopping:
    """`stopping()` is true from the signal (or the engine's death) on."""

    def __init__(self, app: ASGIApp, stopping: Callable[[], bool]) -> None:
        self.app = app
        self.stopping = stopping

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.stopping():
            refusal = OpenAIError(
                503,
                "The server is shutting down and takes no new requests.",
                type=SERVER_ERROR,
                code="server_shutting_down",
                headers={"Connection": "close"},
            )
            await error_response(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)
