"""Scoring (query, document) pairs, as vLLM's `score` task: a cross-encoder scores each pair
in one forward; an embedding model scores it by the cosine similarity of the two embeddings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch.nn.functional as F

from tokenmill.pooling.engine import PoolingResult
from tokenmill.pooling.inputs import PoolingPrompts
from tokenmill.pooling.runner import PoolingInput
from tokenmill.sampling_params import InvalidRequestError


@dataclass(frozen=True)
class PairScore:
    score: float
    num_prompt_tokens: int


@dataclass(frozen=True)
class ScorePlan:
    """The forwards a scoring request needs, and how their results become one score a pair."""

    inputs: list[PoolingInput]
    combine: Callable[[list[PoolingResult]], list[PairScore]]


def pair_up(
    queries: str | Sequence[str], documents: str | Sequence[str], param: str = "documents"
) -> list[tuple[str, str]]:
    """vLLM's pairing: one query with every document, or the i-th with the i-th."""
    query_list = [queries] if isinstance(queries, str) else list(queries)
    document_list = [documents] if isinstance(documents, str) else list(documents)
    if not document_list:
        raise InvalidRequestError(param, "must not be empty")
    if len(query_list) == 1:
        query_list = query_list * len(document_list)
    if len(query_list) != len(document_list):
        raise InvalidRequestError(
            param,
            f"must be one per query or the queries one: got {len(query_list)} queries and "
            f"{len(document_list)} documents",
        )
    return list(zip(query_list, document_list))


def plan_scores(
    prompts: PoolingPrompts,
    pairs: list[tuple[str, str]],
    cross_encoder: bool,
    truncate_prompt_tokens: int | None = None,
) -> ScorePlan:
    if cross_encoder:
        inputs = [prompts.pair(q, d, truncate_prompt_tokens) for q, d in pairs]
        return ScorePlan(inputs, _cross_encoder_scores)
    inputs = [
        prompts.embed(text, truncate_prompt_tokens, param=param)
        for q, d in pairs
        for text, param in ((q, "queries"), (d, "documents"))
    ]
    return ScorePlan(inputs, _cosine_scores)


def _cross_encoder_scores(results: list[PoolingResult]) -> list[PairScore]:
    return [PairScore(float(r.data), r.num_prompt_tokens) for r in results]


def _cosine_scores(results: list[PoolingResult]) -> list[PairScore]:
    scores = []
    for query, document in zip(results[::2], results[1::2]):
        cosine = F.cosine_similarity(query.data[None], document.data[None]).item()
        scores.append(PairScore(cosine, query.num_prompt_tokens + document.num_prompt_tokens))
    return scores
