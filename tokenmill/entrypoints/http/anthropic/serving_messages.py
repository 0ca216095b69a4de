"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path
(anthropic/convert.py maps the fields), with Anthropic's errors,
`{"type": "error", "error": {"type", "message"}}`, and its key header: with `--api-key`,
`x-api-key` or a bearer token.

The body is parsed here, not by FastAPI, so that a malformed one is answered in Anthropic's
shape too (the app's handlers answer OpenAI's).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from tokenmill.entrypoints.http.anthropic.convert import chat_request, message_response
from tokenmill.entrypoints.http.anthropic.protocol import (
    AnthropicErrorInfo,
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
)
from tokenmill.entrypoints.http.anthropic.stream import MessageEvents, message_events, sse
from tokenmill.entrypoints.http.context import ServerContext, log_ignored_fields
from tokenmill.entrypoints.http.openai.protocol import ChatCompletionChunk, ChatCompletionResponse
from tokenmill.entrypoints.http.openai.serving_chat import start_chat_run
from tokenmill.entrypoints.http.replies.tool_calling import template_tools
from tokenmill.entrypoints.http.transport.api_keys import ApiKeys
from tokenmill.entrypoints.http.transport.errors import OpenAIError, error_info, log_server_error
from tokenmill.entrypoints.http.transport.streaming import EventStreamResponse, cancel_on_disconnect

ModelT = TypeVar("ModelT", bound=BaseModel)
# Anthropic's error types by status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error(error: BaseException) -> tuple[int, AnthropicErrorResponse]:
    status, info = error_info(error)
    message = info.message if info.param is None else f"{info.param}: {info.message}"
    error_type = ERROR_TYPES.get(status, "api_error")
    return status, AnthropicErrorResponse(
        error=AnthropicErrorInfo(type=error_type, message=message)
    )


def error_event(error: BaseException) -> str:
    _, body = anthropic_error(error)
    return sse("error", {"error": body.error.model_dump()})


async def answer_anthropic(
    given_key: str, keys: ApiKeys, handler: Callable[[], Awaitable[Response]]
) -> Response:
    """Run `handler` after the key check, every failure answered in Anthropic's shape."""
    try:
        check_key(given_key, keys)
        return await handler()
    except ValidationError as e:  # a body valid here but not for the chat path
        return _error_response(OpenAIError(400, _validation_message(e)))
    except Exception as e:
        log_server_error(e, "an Anthropic route")
        return _error_response(e)


def _error_response(error: BaseException) -> JSONResponse:
    status, body = anthropic_error(error)
    headers = error.headers if isinstance(error, OpenAIError) else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _validation_message(error: ValidationError) -> str:
    """The deepest failure, named by its field path: a union's members (`str`, `list[...]`,
    block tags like `<text>`) are left out of the path, so `messages.0.content.0.text`."""
    deepest = max(error.errors(), key=lambda e: len(e.get("loc", ())))
    parts = [str(part) for part in deepest.get("loc", ())]
    where = ".".join(p for p in parts if not _union_member(p)) or "body"
    return f"{where}: {deepest.get('msg', 'invalid')}"


def _union_member(part: str) -> bool:
    return "[" in part or part.startswith("<") or part in ("str", "int", "float", "bool")


def check_key(given: str, keys: ApiKeys) -> None:
    """`given`: the x-api-key header, else the bearer token, else empty."""
    if keys and keys.match(given) is None:
        raise OpenAIError(401, "invalid x-api-key: pass the server's --api-key")


async def parse_body(raw_request: Request, model: type[ModelT]) -> ModelT:
    """Parsed and validated on a worker thread: a 2 MiB body takes a good part of a second,
    which would stall every other client on the event loop."""
    body = await raw_request.body()
    try:
        return await asyncio.to_thread(model.model_validate_json, body)
    except ValidationError as e:
        raise OpenAIError(400, _validation_message(e)) from None


async def create_message(ctx: ServerContext, raw_request: Request) -> Response:
    arrival_time = time.time()
    request = await parse_body(raw_request, MessagesRequest)
    ctx.check_model(request.model)
    log_ignored_fields(request, "/v1/messages")
    run = await start_chat_run(ctx, chat_request(request))
    stream = await run.start(raw_request, arrival_time)
    if stream is None:
        return Response(status_code=499)  # gone while its constraint compiled
    message_id = f"msg_{uuid.uuid4().hex}"
    if request.stream:
        num_input_tokens = len(run.prompts[0].prompt.token_ids)
        state = MessageEvents(message_id, ctx.model_name, num_input_tokens)
        return EventStreamResponse(_events(state, run.chunk_stream(stream)))
    reply = await cancel_on_disconnect(raw_request, run.collect(stream))
    if reply is None:
        return Response(status_code=499)
    assert isinstance(reply, ChatCompletionResponse)
    return JSONResponse(message_response(reply, message_id).model_dump())


async def _events(
    state: MessageEvents, chunks: AsyncIterator[ChatCompletionChunk]
) -> AsyncIterator[str]:
    async with aclosing(chunks):  # closing the events aborts the engine request at once
        async for event in message_events(state, chunks, error_event):
            yield event


async def count_tokens(ctx: ServerContext, raw_request: Request) -> Response:
    request = await parse_body(raw_request, CountTokensRequest)
    ctx.check_model(request.model)
    chat = chat_request(request)
    prompt = await ctx.off_loop(ctx.prompts.chat_prompt, chat.messages, tools=template_tools(chat))
    return JSONResponse(CountTokensResponse(input_tokens=len(prompt.token_ids)).model_dump())
