"""The pooling endpoints' work: inputs checked and tokenized off the event loop, pooled by
the engine's thread, answered in each protocol's shape."""

from __future__ import annotations

import asyncio
import base64
import functools
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import numpy as np

from tokenmill.entrypoints.http.pooling.protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from tokenmill.entrypoints.http.transport.errors import bad_request, model_not_found
from tokenmill.pooling.async_engine import AsyncPoolingEngine
from tokenmill.pooling.runner import PoolingInput
from tokenmill.pooling.scoring import PairScore, pair_up, plan_scores

P = ParamSpec("P")
T = TypeVar("T")


@dataclass
class PoolingServerContext:
    engine: AsyncPoolingEngine
    model_names: list[str]
    model_root: str
    created: int = field(default_factory=lambda: int(time.time()))
    stopping: bool = False

    def __post_init__(self) -> None:
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-tokenizer")

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.service.max_model_len

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise model_not_found(model, self.model_names)

    async def off_loop(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        call = functools.partial(function, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, call)

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)


def _embedding_prompts(value: Any) -> list[str | list[int]]:
    """OpenAI's input shapes as a list of prompts (a text or token ids each)."""
    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif value and all(isinstance(v, int) for v in value):
        prompts = [value]
    else:
        prompts = list(value)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise bad_request("input must not be empty, nor hold an empty text", param="input")
    return prompts


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def create_embeddings(
    ctx: PoolingServerContext, request: EmbeddingRequest
) -> EmbeddingResponse:
    ctx.check_model(request.model)
    service = ctx.engine.service
    if service.is_cross_encoder:
        raise bad_request(
            "this model is a cross-encoder: it scores pairs (/v1/score, /v1/rerank) and has "
            "no embeddings",
            param="model",
        )
    prompts = _embedding_prompts(request.input)

    def tokenize() -> list[PoolingInput]:
        return [
            service.prompts.embed(
                p, request.truncate_prompt_tokens, request.dimensions, param="input"
            )
            for p in prompts
        ]

    inputs = await ctx.off_loop(tokenize)
    results = await ctx.engine.run(inputs)
    data = [
        EmbeddingData(index=i, embedding=_encode(r.data.numpy(), request.encoding_format))
        for i, r in enumerate(results)
    ]
    tokens = sum(r.num_prompt_tokens for r in results)
    return EmbeddingResponse(
        id=f"embd-{uuid.uuid4().hex}",
        model=ctx.model_name,
        data=data,
        usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


async def _score_pairs(
    ctx: PoolingServerContext, pairs: list[tuple[str, str]], truncate: int | None
) -> list[PairScore]:
    service = ctx.engine.service
    plan = await ctx.off_loop(
        plan_scores, service.prompts, pairs, service.is_cross_encoder, truncate
    )
    return plan.combine(await ctx.engine.run(plan.inputs))


async def create_score(ctx: PoolingServerContext, request: ScoreRequest) -> ScoreResponse:
    ctx.check_model(request.model)
    queries = request.queries if request.queries is not None else request.text_1
    documents = request.documents if request.documents is not None else request.text_2
    if queries is None or documents is None:
        missing = "text_1 (queries)" if queries is None else "text_2 (documents)"
        raise bad_request(f"{missing} is required", param="text_1" if queries is None else "text_2")
    scores = await _score_pairs(
        ctx, pair_up(queries, documents, "text_2"), request.truncate_prompt_tokens
    )
    tokens = sum(s.num_prompt_tokens for s in scores)
    return ScoreResponse(
        id=f"score-{uuid.uuid4().hex}",
        model=ctx.model_name,
        data=[ScoreData(index=i, score=s.score) for i, s in enumerate(scores)],
        usage=PoolingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


async def create_rerank(ctx: PoolingServerContext, request: RerankRequest) -> RerankResponse:
    """Documents by relevance to the query, best first, the first `top_n` (all for 0/None)."""
    ctx.check_model(request.model)
    if request.top_n is not None and request.top_n < 0:
        raise bad_request(f"top_n must be >= 0, got {request.top_n}", param="top_n")
    texts = [d if isinstance(d, str) else d.text for d in request.documents]
    scores = await _score_pairs(
        ctx, pair_up(request.query, texts, "documents"), request.truncate_prompt_tokens
    )
    order = sorted(range(len(texts)), key=lambda i: scores[i].score, reverse=True)
    if request.top_n:
        order = order[: request.top_n]
    results = [
        RerankResult(
            index=i,
            relevance_score=scores[i].score,
            document=RerankDocument(text=texts[i]) if request.return_documents else None,
        )
        for i in order
    ]
    tokens = sum(s.num_prompt_tokens for s in scores)
    return RerankResponse(
        id=f"rerank-{uuid.uuid4().hex}",
        model=ctx.model_name,
        usage=RerankUsage(total_tokens=tokens),
        results=results,
    )
