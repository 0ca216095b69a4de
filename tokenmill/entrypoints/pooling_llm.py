"""`LLM.embed` and `LLM.score`, vLLM's offline pooling API, for an `LLM` whose model serves
a pooling task (`task="embed"` / `"score"`, or `auto` from the checkpoint)."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.pooling.inputs import EmbedPrompt
from tokenmill.pooling.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenmill.pooling.scoring import pair_up, plan_scores
from tokenmill.pooling.service import PoolingService


class PoolingMethods:
    """Mixed into `LLM`: `pooling` is the served pooling model, or None for a generator."""

    pooling: PoolingService | None = None

    def _pooling_service(self, method: str) -> PoolingService:
        if self.pooling is None:
            raise ValueError(
                f"LLM.{method} needs a pooling model: this LLM generates (give task='embed' "
                "or 'score', or a sentence-transformers / *Model / *ForSequenceClassification "
                "checkpoint)"
            )
        return self.pooling

    def embed(
        self,
        prompts: EmbedPrompt | Sequence[EmbedPrompt],
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (a text or token ids), in order."""
        service = self._pooling_service("embed")
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        inputs = [service.prompts.embed(p, truncate_prompt_tokens, dimensions) for p in prompts]
        results = service.run(inputs)
        return [
            EmbeddingRequestOutput(r.request_id, EmbeddingOutput(r.data.tolist()), i.token_ids)
            for r, i in zip(results, inputs)
        ]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`: `text_1` (one, or one per document) against each of `text_2`;
        a cross-encoder's score, or the cosine similarity of an embedding model's vectors."""
        service = self._pooling_service("score")
        plan = plan_scores(
            service.prompts,
            pair_up(text_1, text_2),
            service.is_cross_encoder,
            truncate_prompt_tokens,
        )
        results = service.run(plan.inputs)
        scores = plan.combine(results)
        step = 1 if service.is_cross_encoder else 2
        return [
            ScoringRequestOutput(
                results[i * step].request_id,
                ScoringOutput(s.score),
                plan.inputs[i * step].token_ids,
            )
            for i, s in enumerate(scores)
        ]
