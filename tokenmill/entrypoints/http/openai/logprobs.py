"""Engine log-probabilities -> the two shapes OpenAI uses (legacy completions, and chat)."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from tokenmill.engine.detokenizer import decode_token
from tokenmill.entrypoints.http.openai.protocol import (
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
)
from tokenmill.outputs import Logprob, PositionLogprobs

# OpenAI's stand-in for "too unlikely to say" (JSON has no -Infinity).
MIN_LOGPROB = -9999.0


def completion_logprobs(
    tokenizer: PreTrainedTokenizerBase,
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs | None],
    text_offset: int = 0,
) -> CompletionLogprobs:
    """`positions[i]` holds token i's logprob and the top-k; None where nothing predicted the
    token (the first prompt token). Offsets count characters from `text_offset`."""
    result = CompletionLogprobs(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
    for token_id, position in zip(token_ids, positions):
        token = _token_text(tokenizer, token_id, position)
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        text_offset += len(token)
        if position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_clamp(position[token_id].logprob))
        result.top_logprobs.append(
            {_text(tokenizer, tid, lp): _clamp(lp.logprob) for tid, lp in _by_rank(position)}
        )
    return result


def extend_completion_logprobs(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into.text_offset.extend(more.text_offset)
    into.token_logprobs.extend(more.token_logprobs)
    into.tokens.extend(more.tokens)
    into.top_logprobs.extend(more.top_logprobs)


def chat_logprobs(
    tokenizer: PreTrainedTokenizerBase,
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs],
    num_top: int,
) -> list[ChatTokenLogprob]:
    result = []
    for token_id, position in zip(token_ids, positions):
        top = [
            _chat_top(_text(tokenizer, tid, lp), lp.logprob)
            for tid, lp in _by_rank(position)[:num_top]
        ]
        chosen = _chat_top(_token_text(tokenizer, token_id, position), position[token_id].logprob)
        result.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return result


def _chat_top(token: str, logprob: float) -> ChatTopLogprob:
    return ChatTopLogprob(token=token, logprob=_clamp(logprob), bytes=list(token.encode()))


def _by_rank(position: PositionLogprobs) -> list[tuple[int, Logprob]]:
    """The top-k entries, most likely first (the sampled token's entry may rank anywhere)."""
    return sorted(position.items(), key=lambda item: _rank(item[1]))


def _rank(logprob: Logprob) -> float:
    return float("inf") if logprob.rank is None else logprob.rank


def _token_text(
    tokenizer: PreTrainedTokenizerBase, token_id: int, position: PositionLogprobs | None
) -> str:
    entry = position.get(token_id) if position is not None else None
    return _text(tokenizer, token_id, entry)


def _text(tokenizer: PreTrainedTokenizerBase, token_id: int, entry: Logprob | None) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return decode_token(tokenizer, token_id)


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
