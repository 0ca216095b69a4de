"""The pooling endpoints' wire format: OpenAI's embeddings, vLLM's score, and the rerank
shape Jina and Cohere share (`/v1/rerank`, `/v2/rerank`)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field

from tokenmill.entrypoints.http.openai.protocol import RequestBody, ResponseModel


class EmbeddingRequest(RequestBody):
    model: str | None = None
    # A text, texts, token ids, or lists of token ids (OpenAI's four shapes).
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep at most k tokens (-1: the limit)


class EmbeddingData(ResponseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # floats, or base64 of little-endian float32


class PoolingUsage(ResponseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ScoreRequest(RequestBody):
    """vLLM's: `text_1` (one text, or one per `text_2`) against each of `text_2`; `queries`
    and `documents` are the newer names for the same two fields."""

    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    truncate_prompt_tokens: int | None = None


class ScoreData(ResponseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ResponseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocumentIn(BaseModel):
    text: str


class RerankRequest(RequestBody):
    model: str | None = None
    query: str
    documents: list[str | RerankDocumentIn]
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None


class RerankDocument(ResponseModel):
    text: str


class RerankResult(ResponseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = Field(None, exclude_if=lambda v: v is None)


class RerankUsage(ResponseModel):
    total_tokens: int


class RerankResponse(ResponseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
