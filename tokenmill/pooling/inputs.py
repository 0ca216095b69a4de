"""Pooling prompts to tokens, checked once: texts or token ids for embeddings, (query,
document) pairs for a cross-encoder; `truncate_prompt_tokens` and `dimensions` as vLLM
takes them. Every fault is an `InvalidRequestError` naming its field (a 400 over HTTP)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from tokenmill.engine.intake import check_prompt_tokens
from tokenmill.pooling.config import PoolingConfig
from tokenmill.pooling.runner import PoolingInput
from tokenmill.sampling_params import InvalidRequestError

EmbedPrompt = str | Sequence[int]


class PoolingPrompts:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        config: PoolingConfig,
        vocab_size: int,
        max_model_len: int,
        hidden_size: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.hidden_size = hidden_size

    def truncation(self, truncate_prompt_tokens: int | None) -> int | None:
        """vLLM's `truncate_prompt_tokens`: keep at most k tokens (-1: max_model_len)."""
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens == -1:
            return self.max_model_len
        if not 1 <= truncate_prompt_tokens <= self.max_model_len:
            raise InvalidRequestError(
                "truncate_prompt_tokens",
                f"must be -1 or between 1 and max_model_len ({self.max_model_len}), "
                f"got {truncate_prompt_tokens}",
            )
        return truncate_prompt_tokens

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        if not self.config.is_matryoshka:
            raise InvalidRequestError(
                "dimensions",
                "is not supported by this model: it has no Matryoshka representation "
                "(config.json names no matryoshka_dimensions)",
            )
        allowed = self.config.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise InvalidRequestError(
                "dimensions", f"must be one of {list(allowed)}, got {dimensions}"
            )
        if not 1 <= dimensions <= self.hidden_size:
            raise InvalidRequestError(
                "dimensions", f"must be between 1 and {self.hidden_size}, got {dimensions}"
            )

    def embed(
        self,
        prompt: EmbedPrompt,
        truncate_prompt_tokens: int | None = None,
        dimensions: int | None = None,
        param: str = "input",
        add_special_tokens: bool = True,
    ) -> PoolingInput:
        self.check_dimensions(dimensions)
        keep = self.truncation(truncate_prompt_tokens)
        if isinstance(prompt, str):
            token_ids = self._encode(prompt, None, keep, add_special_tokens)["input_ids"]
        else:
            token_ids = [int(t) for t in prompt]
            if keep is not None:
                token_ids = token_ids[-keep:]
        check_prompt_tokens(token_ids, self.vocab_size, self.max_model_len, param)
        return PoolingInput(token_ids, task="embed", dimensions=dimensions)

    def pair(
        self,
        query: str,
        document: str,
        truncate_prompt_tokens: int | None = None,
        param: str = "documents",
    ) -> PoolingInput:
        """A cross-encoder's input: the pair as its tokenizer joins them, with the segment
        ids BERT tells them apart by."""
        keep = self.truncation(truncate_prompt_tokens)
        if self.config.yes_no_tokens is not None:
            # A decoder reranker reads the two texts one after the other (the caller writes
            # its prompt format into them, as for Qwen3-Reranker under vLLM).
            token_ids = self._encode(query, None, None, True)["input_ids"]
            token_ids += self._encode(document, None, None, False)["input_ids"]
            token_ids = token_ids[-keep:] if keep is not None else token_ids
            check_prompt_tokens(token_ids, self.vocab_size, self.max_model_len, param)
            return PoolingInput(token_ids, task="score")
        encoded = self._encode(query, document, keep, True)
        token_ids = encoded["input_ids"]
        check_prompt_tokens(token_ids, self.vocab_size, self.max_model_len, param)
        return PoolingInput(token_ids, encoded.get("token_type_ids"), task="score")

    def _encode(
        self, text: str, pair: str | None, keep: int | None, add_special_tokens: bool
    ) -> dict[str, list[int]]:
        if not isinstance(text, str) or (pair is not None and not isinstance(pair, str)):
            raise InvalidRequestError("input", "must be text or token ids")
        truncation = {"truncation": True, "max_length": keep} if keep is not None else {}
        return self.tokenizer(
            text, pair, add_special_tokens=add_special_tokens, verbose=False, **truncation
        )
