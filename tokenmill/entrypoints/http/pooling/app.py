"""The FastAPI app of a pooling model: `/v1/embeddings`, `/v1/score` (and `/score`),
`/v1/rerank`, `/rerank` and `/v2/rerank`, with the generative server's operational routes
(`/v1/models`, `/health`, `/version`, `/metrics`), keys, body limit and error shape."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Depends, FastAPI
from prometheus_client import CollectorRegistry

from tokenmill.entrypoints.http.app import (
    BAD_REQUEST,
    DEFAULT_MAX_BODY_BYTES,
    NOT_FOUND_RESPONSE,
    SERVER_ERRORS,
    UNAUTHORIZED,
    Responses,
    api_key_check,
    get_and_head,
    metrics_router,
    openapi_without_422,
    operations_router,
    server_shell,
)
from tokenmill.entrypoints.http.openai.protocol import ModelCard, ModelList
from tokenmill.entrypoints.http.pooling.protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from tokenmill.entrypoints.http.pooling.serving import (
    PoolingServerContext,
    create_embeddings,
    create_rerank,
    create_score,
)
from tokenmill.entrypoints.http.transport.api_keys import ApiKeys
from tokenmill.entrypoints.http.transport.offloop_body import OffLoopBodyRoute


def build_pooling_app(
    ctx: PoolingServerContext,
    registry: CollectorRegistry,
    api_key: ApiKeys | str | None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics_without_api_key: bool = False,
) -> FastAPI:
    keys = ApiKeys.of(api_key)

    app = server_shell(ctx, max_body_bytes)
    auth: Responses = UNAUTHORIZED if keys else {}
    errors: Responses = {**BAD_REQUEST, **auth, **SERVER_ERRORS}
    keyed = APIRouter(dependencies=[Depends(api_key_check(keys))], route_class=OffLoopBodyRoute)

    @get_and_head(keyed, "/v1/models", responses=auth)
    async def list_models() -> ModelList:
        return ModelList(data=[_model_card(ctx, name) for name in ctx.model_names])

    @keyed.get("/v1/models/{model_id:path}", responses={**auth, **NOT_FOUND_RESPONSE})
    async def retrieve_model(model_id: str) -> ModelCard:
        ctx.check_model(model_id)
        return _model_card(ctx, model_id)

    @keyed.post("/v1/embeddings", responses=errors)
    async def embeddings(request: EmbeddingRequest) -> EmbeddingResponse:
        return await create_embeddings(ctx, request)

    for path in ("/v1/score", "/score"):
        keyed.add_api_route(path, _score_route(ctx), methods=["POST"], responses=errors)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        keyed.add_api_route(path, _rerank_route(ctx), methods=["POST"], responses=errors)
    app.include_router(keyed)
    app.include_router(operations_router(lambda: ctx.engine.is_healthy))
    app.include_router(metrics_router(registry, ApiKeys() if metrics_without_api_key else keys))
    app.openapi = openapi_without_422(app)  # type: ignore[method-assign]
    return app


def _score_route(ctx: PoolingServerContext) -> Callable[[ScoreRequest], Awaitable[ScoreResponse]]:
    async def score(request: ScoreRequest) -> ScoreResponse:
        return await create_score(ctx, request)

    return score


def _rerank_route(
    ctx: PoolingServerContext,
) -> Callable[[RerankRequest], Awaitable[RerankResponse]]:
    async def rerank(request: RerankRequest) -> RerankResponse:
        return await create_rerank(ctx, request)

    return rerank


def _model_card(ctx: PoolingServerContext, name: str) -> ModelCard:
    return ModelCard(
        id=name, created=ctx.created, root=ctx.model_root, max_model_len=ctx.max_model_len
    )
