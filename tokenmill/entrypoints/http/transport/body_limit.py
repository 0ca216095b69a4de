"""A cap on request body size, for every route: a body is read (and parsed as JSON) on the
event loop that every client shares, so one huge body must be refused before it is read."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.entrypoints.http.transport.errors import OpenAIError, error_response


class BodySizeLimit:
    """ASGI middleware: 413 when `Content-Length` says the body is too large, or when a body
    sent without one (chunked) grows past the limit while it is read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._too_large())(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        num_received = 0

        async def counted() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:
                    # FastAPI passes HTTPException through from reading the body; the error
                    # handler answers its OpenAIError detail as is (code included).
                    raise HTTPException(413, self._too_large())  # type: ignore[arg-type]
            return message

        return counted

    def _too_large(self) -> OpenAIError:
        return OpenAIError(
            413,
            f"The request body is larger than this server's limit of {self.max_bytes} bytes "
            "(--max-request-body-bytes).",
            code="request_too_large",
        )
