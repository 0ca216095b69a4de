"""Request bodies parsed and validated on a worker thread, not on the event loop: a 2 MiB body
of small messages takes a few hundred milliseconds to turn into a request model, and every
other client (even /health) waited that long.

FastAPI validates what `Request.json()` returns against the route's body model; given an
instance of that model it takes it as is (pydantic does not revalidate instances). So the
route's request parses and validates in a thread and hands FastAPI the finished model. A body
that fails validation is handed back as parsed JSON instead, for FastAPI to validate again on
the loop and answer its 400 exactly as before (naming the field, releasing any KV hold)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError


class OffLoopBodyRoute(APIRoute):
    """An APIRoute whose JSON body (a pydantic model) is parsed and validated off the loop."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        body_type = self.body_field.field_info.annotation if self.body_field else None
        if not (isinstance(body_type, type) and issubclass(body_type, BaseModel)):
            return handler
        model: type[BaseModel] = body_type

        async def off_loop_handler(request: Request) -> Response:
            return await handler(_OffLoopJSONRequest(request.scope, request.receive, model))

        return off_loop_handler


class _OffLoopJSONRequest(Request):
    def __init__(self, scope: Any, receive: Any, model: type[BaseModel]) -> None:
        super().__init__(scope, receive)
        self._model = model

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.to_thread(_parse, body, self._model)
        return self._json


def _parse(body: bytes, model: type[BaseModel]) -> Any:
    """The model, or (invalid) the parsed JSON; json.JSONDecodeError as FastAPI expects it."""
    data = json.loads(body)
    try:
        return model.model_validate(data)
    except ValidationError:
        return data
