"""The FastAPI app: OpenAI's routes plus vLLM's operational ones, each declaring its errors.

With an API key set, every route that costs the engine or the tokenizer work, changes state
or tells one client about another's requests needs it: `/v1/*`, `/dashboard*`, `/tokenize`,
`/detokenize`, `/reset_prefix_cache` and `/metrics` (its prefix-cache counters move with other
clients' prompts; `--metrics-without-api-key` opens it for scrapers that cannot send a key).
`/health` and `/version` stay open for probes, `/openapi.json` for readers. No `/docs` or
`/redoc`: FastAPI's pages load unpinned scripts from a CDN. Every body is capped in size.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from tokenmill.engine.async_engine import EngineDeadError
from tokenmill.entrypoints.dashboard.routes import dashboard_router
from tokenmill.entrypoints.http.agent_routes import (
    add_responses_routes,
    messages_router,
    response_store,
)
from tokenmill.entrypoints.http.context import ServerContext
from tokenmill.entrypoints.http.lora_adapters import runtime_updating_allowed
from tokenmill.entrypoints.http.lora_routes import lora_router
from tokenmill.entrypoints.http.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from tokenmill.entrypoints.http.openai.serving_chat import create_chat_completion
from tokenmill.entrypoints.http.openai.serving_completion import create_completion
from tokenmill.entrypoints.http.openai.serving_tokenization import (
    detokenize_tokens,
    tokenize_prompt,
)
from tokenmill.entrypoints.http.responses.store import DEFAULT_MAX_STORED_BYTES, ResponseStore
from tokenmill.entrypoints.http.transport.api_keys import ApiKeys, remember_key
from tokenmill.entrypoints.http.transport.body_limit import BodySizeLimit
from tokenmill.entrypoints.http.transport.errors import (
    ErrorResponse,
    OpenAIError,
    RefusedBody,
    error_response,
    install_error_handlers,
    refused_body,
)
from tokenmill.entrypoints.http.transport.middleware import NoSniff, RefuseWhileStopping
from tokenmill.entrypoints.http.transport.offloop_body import OffLoopBodyRoute
from tokenmill.version import __version__

Responses = dict[int | str, dict[str, Any]]
Endpoint = Callable[..., Any]


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


NOT_FOUND_RESPONSE: Responses = {404: _error("No such model (`model_not_found`)")}
BAD_REQUEST: Responses = {
    400: _error("Invalid request: parameters, prompt length"),
    **NOT_FOUND_RESPONSE,
}
UNAUTHORIZED: Responses = {401: _error("Missing or wrong API key")}
ENGINE_DEAD: Responses = {503: _error("The engine is not running")}
SERVER_ERRORS: Responses = {
    500: _error("The engine failed while running this request"),
    **ENGINE_DEAD,
}


# Module level: FastAPI resolves (string) annotations against module globals.
_BEARER = HTTPBearer(auto_error=False, description="The server's --api-key")
BearerCredentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]


# One server-sent event (OpenAPI before 3.2 has the stream's schema describe each event).
SSE_EVENT = {
    "type": "object",
    "properties": {
        "data": {
            "type": "string",
            "description": "A chunk as JSON, an error as JSON, or `[DONE]` to end the stream",
        }
    },
    "required": ["data"],
}


def _streamable(model: type) -> Responses:
    """200 is JSON, or with `stream: true` server-sent events of chunks."""
    return {
        200: {
            "model": model,
            "description": "The result, or with `stream: true` a stream of chunks",
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
        }
    }


DEFAULT_MAX_BODY_BYTES = 2 * 1024 * 1024


def build_app(
    ctx: ServerContext,
    registry: CollectorRegistry,
    api_key: ApiKeys | str | None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics_without_api_key: bool = False,
    responses_store_max_bytes: int = DEFAULT_MAX_STORED_BYTES,
) -> FastAPI:
    """`api_key`: the keys the keyed routes take (a string is one; None or none: open)."""
    keys = ApiKeys.of(api_key)
    store = response_store(registry, ctx.model_name, responses_store_max_bytes)

    app = server_shell(ctx, max_body_bytes, ctx.refused)
    app.state.response_store = store
    app.include_router(_v1_router(ctx, keys, store))
    app.include_router(messages_router(ctx, keys))  # its own key check (x-api-key too)
    app.include_router(operations_router(lambda: ctx.engine.is_healthy))
    app.include_router(metrics_router(registry, ApiKeys() if metrics_without_api_key else keys))
    app.include_router(_keyed_operations_router(ctx, keys))
    app.include_router(dashboard_router(ctx, keys))
    app.openapi = openapi_without_422(app)  # type: ignore[method-assign]
    return app


def server_shell(ctx: Any, max_body_bytes: int, refused: RefusedBody | None = None) -> FastAPI:
    """The app every server kind starts from: the engine started and stopped with it, error
    handlers, the body limit, refusals while stopping, nosniff. `ctx` has `engine` (`start`,
    `shutdown`), `close` and `stopping`; `refused` counts refused requests (None: not counted)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        yield
        ctx.engine.shutdown()
        ctx.close()

    # No Swagger UI or ReDoc pages (they load CDN scripts without integrity hashes), so no
    # OAuth2 redirect page either; every open route is one docs/server.md lists.
    app = FastAPI(
        title="tokenmill",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
    )
    install_error_handlers(app, refused)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    app.add_middleware(RefuseWhileStopping, stopping=lambda: ctx.stopping)
    app.add_middleware(NoSniff)  # outermost: on every response, the refusals' too
    return app


def _v1_router(ctx: ServerContext, keys: ApiKeys, store: ResponseStore) -> APIRouter:
    auth: Responses = UNAUTHORIZED if keys else {}
    router = APIRouter(
        prefix="/v1",
        dependencies=[Depends(api_key_check(keys))],
        route_class=OffLoopBodyRoute,
    )

    @get_and_head(router, "/models", responses=auth)
    async def list_models() -> ModelList:
        cards = [_model_card(ctx, name) for name in ctx.model_names]
        return ModelList(data=cards + adapter_cards(ctx))

    @router.get("/models/{model_id:path}", responses={**auth, **NOT_FOUND_RESPONSE})
    async def retrieve_model(model_id: str) -> ModelCard:
        ctx.check_model(model_id)
        card = next((c for c in adapter_cards(ctx) if c.id == model_id), None)
        return card or _model_card(ctx, model_id)

    @router.post(
        "/completions",
        response_model=None,
        responses={**_streamable(CompletionResponse), **BAD_REQUEST, **auth, **SERVER_ERRORS},
    )
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        with refused_body(ctx.refused, request):
            return await create_completion(ctx, request, raw_request)

    @router.post(
        "/chat/completions",
        response_model=None,
        responses={**_streamable(ChatCompletionResponse), **BAD_REQUEST, **auth, **SERVER_ERRORS},
    )
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        with refused_body(ctx.refused, request):
            return await create_chat_completion(ctx, request, raw_request)

    add_responses_routes(router, ctx, store, {**BAD_REQUEST, **auth, **SERVER_ERRORS})
    if ctx.adapters is not None and runtime_updating_allowed():
        router.include_router(lora_router(ctx.adapters, {**BAD_REQUEST, **auth}))
    return router


def operations_router(is_healthy: Callable[[], bool]) -> APIRouter:
    """`/health` (503 once the engine has stopped) and `/version`: every server kind's."""
    router = APIRouter()

    @get_and_head(
        router,
        "/health",
        response_class=Response,
        responses={200: {"description": "The engine is running"}, **ENGINE_DEAD},
    )
    async def health() -> Response:
        if not is_healthy():
            return error_response(EngineDeadError("the engine is not running"))
        return Response(status_code=200)

    @get_and_head(router, "/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    return router


def metrics_router(registry: CollectorRegistry, keys: ApiKeys) -> APIRouter:
    """`/metrics`, behind `keys` unless there are none."""
    auth: Responses = UNAUTHORIZED if keys else {}
    router = APIRouter(dependencies=[Depends(api_key_check(keys))])

    @get_and_head(
        router,
        "/metrics",
        response_class=Response,
        responses={200: _prometheus_text(), **auth},
    )
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router


def _keyed_operations_router(ctx: ServerContext, keys: ApiKeys) -> APIRouter:
    """vLLM's operational routes that mutate state or cost work: behind the keys, if any."""
    auth: Responses = UNAUTHORIZED if keys else {}
    router = APIRouter(dependencies=[Depends(api_key_check(keys))], route_class=OffLoopBodyRoute)

    @router.post(
        "/reset_prefix_cache",
        response_class=Response,
        responses={200: {"description": "Every cached prefix is forgotten"}, **auth, **ENGINE_DEAD},
    )
    async def reset_prefix_cache() -> Response:
        await ctx.engine.reset_prefix_cache()
        return Response(status_code=200)

    @router.post("/tokenize", responses={**BAD_REQUEST, **auth})
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return await ctx.off_loop(tokenize_prompt, ctx, request)

    @router.post("/detokenize", responses={**BAD_REQUEST, **auth})
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return await ctx.off_loop(detokenize_tokens, ctx, request)

    return router


def get_and_head(router: APIRouter, path: str, **route: Any) -> Callable[[Endpoint], Endpoint]:
    """A GET route that answers HEAD too (the same status and headers, no body: uvicorn drops
    it), for probes that check with HEAD first (aiperf). HEAD stays out of /openapi.json."""

    def register(endpoint: Endpoint) -> Endpoint:
        router.add_api_route(path, endpoint, methods=["GET"], **route)
        router.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False, **route)
        return endpoint

    return register


def api_key_check(keys: ApiKeys) -> Callable[..., Any]:
    """A dependency of every keyed route: a bearer token equal to one of the keys (compared in
    constant time), noted on the request (stored responses are the key's own); or no check
    at all without keys."""
    if not keys:

        async def open_access() -> None:
            return None

        return open_access

    async def check(request: Request, credentials: BearerCredentials) -> None:
        given = credentials.credentials if credentials is not None else ""
        key = keys.match(given)
        remember_key(request, key)
        if key is None:
            raise OpenAIError(
                401,
                "Incorrect API key provided. Pass the server's --api-key as a bearer token.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},  # RFC 9110: a 401 names its scheme
            )

    return check


def _model_card(ctx: ServerContext, name: str) -> ModelCard:
    return ModelCard(
        id=name,
        created=ctx.created,
        root=ctx.model_root,
        max_model_len=ctx.max_model_len,
        weight_format=ctx.weight_format,
    )


def adapter_cards(ctx: ServerContext) -> list[ModelCard]:
    """A card per LoRA adapter served: its path as `root`, its base model as `parent`."""
    return [
        ModelCard(
            id=adapter.lora_name,
            created=ctx.created,
            root=adapter.lora_path,
            parent=adapter.base_model_name or ctx.model_name,
            max_model_len=ctx.max_model_len,
            weight_format=ctx.weight_format,
        )
        for adapter in ctx.adapters or ()
    ]


def _prometheus_text() -> dict[str, Any]:
    return {
        "description": "Prometheus text exposition",
        "content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
    }


def openapi_without_422(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """Invalid input is answered 400 in OpenAI's error shape, never FastAPI's 422, so the
    generated document must not promise a 422 either."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, routes=app.routes, description=__doc__
            )
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi
