"""Server-sent events, and noticing that a client has gone so its request stops costing KV."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE_EVENT = "data: [DONE]\n\n"


def sse_event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that always closes its generator, whether the stream ran
    out, the client disconnected or the task was cancelled, so the generator's `finally`
    aborts the engine requests at once rather than whenever the garbage collector gets to it."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self._events = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()


async def cancel_on_disconnect(request: Request, handler: Coroutine[Any, Any, T]) -> T | None:
    """Run a non-streaming handler, cancelling it if the client disconnects first (its
    `finally` then aborts the engine requests); None then. A stream notices on its own, when
    writing to the closed connection fails."""
    work = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
    return work.result() if work.done() else None


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
