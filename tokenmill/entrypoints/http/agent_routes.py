"""The routes agents speak besides chat: Anthropic's `/v1/messages` (+ `count_tokens`) and
OpenAI's `/v1/responses`. Each handler checks the key itself (Anthropic clients send
`x-api-key`) and answers errors in its own API's shape."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry

from tokenmill.entrypoints.http.anthropic.protocol import (
    AnthropicErrorResponse,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
)
from tokenmill.entrypoints.http.anthropic.serving_messages import (
    answer_anthropic,
    count_tokens,
    create_message,
)
from tokenmill.entrypoints.http.context import ServerContext
from tokenmill.entrypoints.http.responses.protocol import ResponsesRequest
from tokenmill.entrypoints.http.responses.serving_responses import (
    create_response,
    delete_response,
    retrieve_response,
)
from tokenmill.entrypoints.http.responses.store import EVICTION_REASONS, ResponseStore
from tokenmill.entrypoints.http.transport.api_keys import ApiKeys, request_key
from tokenmill.entrypoints.http.transport.errors import ErrorResponse
from tokenmill.metrics.prometheus import ResponseStoreMetrics

# Either header carries the key (Anthropic's clients send x-api-key); declared so that
# /openapi.json says so. Checked by the handler, which answers in its API's error shape.
_X_API_KEY = APIKeyHeader(name="x-api-key", auto_error=False, description="The --api-key")
_BEARER = HTTPBearer(auto_error=False, description="The server's --api-key")
XApiKey = Annotated[str | None, Depends(_X_API_KEY)]
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]

SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def _body(model: type) -> dict[str, Any]:
    """The request body in /openapi.json (the handler parses it itself)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _errors(model: type, statuses: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": model, "description": "An error"} for status in statuses}


def _given_key(x_api_key: str | None, bearer: HTTPAuthorizationCredentials | None) -> str:
    if x_api_key is not None:
        return x_api_key
    return bearer.credentials if bearer is not None else ""


def messages_router(ctx: ServerContext, keys: ApiKeys) -> APIRouter:
    router = APIRouter(prefix="/v1")
    errors = _errors(AnthropicErrorResponse, (400, 401, 404, 500, 503))

    @router.post(
        "/messages",
        response_model=None,
        responses={200: {"model": MessageResponse, "content": SSE}, **errors},
        openapi_extra=_body(MessagesRequest),
    )
    async def messages(raw_request: Request, x_api_key: XApiKey, bearer: Bearer) -> Response:
        given = _given_key(x_api_key, bearer)
        return await answer_anthropic(given, keys, lambda: create_message(ctx, raw_request))

    @router.post(
        "/messages/count_tokens",
        response_model=None,
        responses={200: {"model": CountTokensResponse}, **errors},
        openapi_extra=_body(CountTokensRequest),
    )
    async def messages_count_tokens(
        raw_request: Request, x_api_key: XApiKey, bearer: Bearer
    ) -> Response:
        given = _given_key(x_api_key, bearer)
        return await answer_anthropic(given, keys, lambda: count_tokens(ctx, raw_request))

    return router


def response_store(registry: CollectorRegistry, model_name: str, max_bytes: int) -> ResponseStore:
    """The server's one store of responses, its size and evictions on /metrics."""
    store = ResponseStore(max_bytes=max_bytes)
    metrics = ResponseStoreMetrics(registry, model_name, lambda: store.num_bytes, EVICTION_REASONS)
    store.on_evict = metrics.evicted
    return store


def add_responses_routes(
    router: APIRouter,
    ctx: ServerContext,
    store: ResponseStore,
    errors: dict[int | str, dict[str, Any]],
) -> None:
    """/responses on the /v1 router (its bearer key check, which notes the request's key: a
    stored response is its key's own; OpenAI's errors)."""
    not_found = {404: {"model": ErrorResponse, "description": "No such stored response"}}
    streamed = {200: {"description": "The response, or with `stream: true` its events",
                      "content": SSE}}  # fmt: skip

    @router.post("/responses", response_model=None, responses={**streamed, **errors})
    async def responses(request: ResponsesRequest, raw_request: Request) -> Response:
        return await create_response(ctx, store, request, raw_request)

    @router.get(
        "/responses/{response_id}",
        response_model=None,
        responses={200: {"description": "The stored response"}, **errors, **not_found},
    )
    async def get_response(response_id: str, raw_request: Request) -> dict[str, Any]:
        return retrieve_response(store, response_id, request_key(raw_request))

    @router.delete(
        "/responses/{response_id}",
        response_model=None,
        responses={200: {"description": "Deleted"}, **errors, **not_found},
    )
    async def remove_response(response_id: str, raw_request: Request) -> dict[str, Any]:
        return delete_response(store, response_id, request_key(raw_request))
