"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat
path (responses/convert.py maps the fields). `previous_response_id` continues a stored
conversation; `store: false` keeps a response out of the store. Errors are OpenAI's."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.entrypoints.http.context import ServerContext, log_ignored_fields
from tokenmill.entrypoints.http.openai.protocol import ChatCompletionResponse
from tokenmill.entrypoints.http.openai.serving_chat import ChatRun, start_chat_run
from tokenmill.entrypoints.http.responses.convert import (
    chat_request,
    input_messages,
    output_items,
    output_messages,
    response_object,
    usage_object,
)
from tokenmill.entrypoints.http.responses.ids import REPLICA_TAG_HEADER, response_id
from tokenmill.entrypoints.http.responses.protocol import ResponsesRequest
from tokenmill.entrypoints.http.responses.store import ResponseStore
from tokenmill.entrypoints.http.responses.stream import ResponseEvents
from tokenmill.entrypoints.http.transport.api_keys import request_key
from tokenmill.entrypoints.http.transport.errors import OpenAIError, bad_request, error_info
from tokenmill.entrypoints.http.transport.streaming import EventStreamResponse, cancel_on_disconnect

logger = logging.getLogger(__name__)


async def create_response(
    ctx: ServerContext, store: ResponseStore, request: ResponsesRequest, raw_request: Request
) -> Response:
    arrival_time = time.time()
    ctx.check_model(request.model)
    log_ignored_fields(request, "/v1/responses")
    owner = request_key(raw_request)  # a stored response is its API key's own
    history = _history(store, request.previous_response_id, owner)
    turns = history + input_messages(request)
    if not turns:  # nothing to answer (instructions alone are no turn); as OpenAI: a 400
        raise bad_request(
            "Invalid 'input': empty array. Expected at least one input item.", param="input"
        )
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    run = await start_chat_run(ctx, chat_request(request, system + turns))
    stream = await run.start(raw_request, arrival_time)
    if stream is None:
        return Response(status_code=499)  # gone while its constraint compiled
    # Behind a router: the id names this replica, so later requests for it come here (ids.py).
    new_response_id = response_id(raw_request.headers.get(REPLICA_TAG_HEADER))

    def finished(output: list[dict[str, Any]], finish: str | None) -> dict[str, Any]:
        usage = usage_object(
            sum(len(p.prompt.token_ids) for p in run.prompts),
            sum(len(c.token_ids) for c in run.choices),
            sum(p.num_cached_tokens for p in run.prompts),
        )
        incomplete = finish == "length"
        status = "incomplete" if incomplete else "completed"
        response = response_object(
            request, new_response_id, ctx.model_name, arrival_time, status, output, usage,
            incomplete,
        )  # fmt: skip
        if request.store:
            store.put(response, turns + output_messages(output), owner)
        return response

    if request.stream:
        return EventStreamResponse(_events(run, stream, request, new_response_id, ctx, finished))
    reply = await cancel_on_disconnect(raw_request, run.collect(stream))
    if reply is None:
        return Response(status_code=499)
    assert isinstance(reply, ChatCompletionResponse)
    return JSONResponse(finished(output_items(reply), reply.choices[0].finish_reason))


def retrieve_response(
    store: ResponseStore, response_id: str, owner: str | None = None
) -> dict[str, Any]:
    """`owner`: the request's API key; another key's response is not found, as OpenAI says."""
    stored = store.get(response_id, owner)
    if stored is None:
        raise _not_found(response_id, "response_id")
    return stored.response


def delete_response(
    store: ResponseStore, response_id: str, owner: str | None = None
) -> dict[str, Any]:
    if not store.delete(response_id, owner):
        raise _not_found(response_id, "response_id")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _history(
    store: ResponseStore, previous_response_id: str | None, owner: str | None
) -> list[dict[str, Any]]:
    if previous_response_id is None:
        return []
    stored = store.get(previous_response_id, owner)
    if stored is None:
        raise _not_found(previous_response_id, "previous_response_id")
    return list(stored.messages)


def _not_found(response_id: str, param: str) -> OpenAIError:
    return OpenAIError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", param
    )


async def _events(
    run: ChatRun,
    stream: Any,
    request: ResponsesRequest,
    response_id: str,
    ctx: ServerContext,
    finished: Any,
) -> AsyncIterator[str]:
    def snapshot(status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        return response_object(
            request, response_id, ctx.model_name, time.time(), status, output, None
        )

    state = ResponseEvents(snapshot)
    for event in state.opening():
        yield event
    try:
        async with aclosing(run.chunk_stream(stream)) as chunks:
            async for chunk in chunks:
                for event in state.events(chunk):
                    yield event
    except Exception as e:
        logger.warning("responses stream %s failed: %r", response_id, e)
        _, info = error_info(e)
        yield f"event: error\ndata: {info.model_dump_json()}\n\n"
        return
    state.snapshot = lambda status, output: finished(output, state.finish_reason)
    for event in state.closing():
        yield event
