"""Incremental detokenization for streaming, with stop strings (vLLM semantics).

Re-decoding the whole output every step is O(n^2) over a generation, and decoding tokens one
by one breaks multi-byte characters that span tokens and context-dependent decoders (e.g. a
SentencePiece "▁word" loses its space at the start of a decode). So text is produced by a
decode stream over a small sliding window, primed with the prompt's last tokens, that only
emits text once it no longer ends in an incomplete character.
"""

from __future__ import annotations

import weakref
from typing import Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens used as decoding context (enough for leading-space and merge behaviour).
_PROMPT_CONTEXT_TOKENS = 6

_INVALID_PREFIX_ERROR = "Invalid prefix"


class _TextStream(Protocol):
    def step(self, token_ids: list[int]) -> str | None:
        """Append tokens; return the newly completed text, or None while a char is incomplete."""
        ...


class _FastStream:
    """`tokenizers.decoders.DecodeStream` (Rust, O(window) per step) behind `_TextStream`."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_ids: list[int]) -> str | None:
        return self._stream.step(self._tokenizer, token_ids)


class _OffsetStream:
    """The classic prefix/read-offset algorithm, for tokenizers without a Rust backend."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._spaces = spaces_between_special_tokens
        self._ids: list[int] = []
        self._read_offset = 0  # ids before this are already emitted; the window starts at 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip, spaces_between_special_tokens=self._spaces
        )

    def step(self, token_ids: list[int]) -> str | None:
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[: self._read_offset])
        full_text = self._decode(self._ids)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return None
        # Keep the last emitted chunk's tokens as the next window's context.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


def _new_stream(
    tokenizer: PreTrainedTokenizerBase,
    skip_special_tokens: bool,
    spaces_between_special_tokens: bool,
) -> _TextStream:
    """A Rust DecodeStream when the tokenizer has a `tokenizers` backend, else the fallback.

    `spaces_between_special_tokens` is a slow (Python) tokenizer's decode option, as in vLLM,
    whose fast-tokenizer path ignores it too: a Rust decoder joins added tokens without spaces.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        return _FastStream(backend, skip_special_tokens)
    return _OffsetStream(tokenizer, skip_special_tokens, spaces_between_special_tokens)


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text as they arrive, applying stop strings.

    `output_text` always equals the decode of the output tokens in the prompt's context (for
    byte-level BPE: exactly `tokenizer.decode(output_ids)`), except that a trailing incomplete
    character is held until the next token, or flushed (as U+FFFD, like a full decode) once the
    sequence finishes.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # Held back while streaming so a partial stop string is never sent.
        longest = max((len(s) for s in self.stop), default=0)
        self.stop_buffer_length = 0 if include_stop_str_in_output else max(longest - 1, 0)
        self.output_token_ids: list[int] = []
        self._text = ""
        # Updates not decoded yet: without stop strings the text waits until it is read, so
        # a step that sends no text (final-only outputs) skips the decoder, which runs cold
        # after the forward. Replayed update by update, the text is the same.
        self._pending: list[list[int]] = []
        self.stop_reason: str | None = None  # the stop string that ended the text, if any
        self._last_output_offset = 0
        self._context = self._prompt_context(prompt_token_ids)
        self._num_emitted = len(self._context)  # tokens of _context + outputs already in text
        self._ids = list(self._context)  # context then outputs (for flush and recovery)
        self._stream = self._primed_stream(self._context)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last tokens, dropping any that end in an incomplete character (which
        would otherwise leak prompt bytes into the output)."""
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        while context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context.pop()
        return context

    def _primed_stream(self, context: list[int]) -> _TextStream:
        """A new stream that has consumed `context` (its text is discarded)."""
        stream = _new_stream(
            self.tokenizer, self.skip_special_tokens, self.spaces_between_special_tokens
        )
        for token_id in context:  # one by one so each token's text is committed as context
            stream.step([token_id])
        return stream

    def _step(self, token_ids: list[int]) -> str:
        """Feed tokens to the stream; return the text they complete ("" while incomplete)."""
        self._ids.extend(token_ids)
        try:
            text = self._stream.step(token_ids)
        except Exception as err:
            if _INVALID_PREFIX_ERROR not in str(err):
                raise
            # Rare non-monotonic decodes break DecodeStream's state: restart it from the
            # last emitted tokens and replay what was not emitted yet.
            start = max(0, self._num_emitted - _PROMPT_CONTEXT_TOKENS)
            self._stream = _OffsetStream(
                self.tokenizer, self.skip_special_tokens, self.spaces_between_special_tokens
            )
            self._stream.step(self._ids[start : self._num_emitted])
            text = self._stream.step(self._ids[self._num_emitted :])
        if text is None:
            return ""
        self._num_emitted = len(self._ids)
        return text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append generated tokens; return the stop string they completed, if any.

        On a stop string the text is cut before it (or after it, with
        include_stop_str_in_output) and later updates are ignored.
        """
        if self.stop_reason is not None or not new_token_ids:
            return None
        self.output_token_ids.extend(new_token_ids)
        if not self.stop:
            self._pending.append(list(new_token_ids))
            return None
        return self._append_text(self._step(list(new_token_ids)))

    @property
    def output_text(self) -> str:
        """The text of the output tokens so far (`get_next_output_text` says what to send)."""
        for token_ids in self._pending:
            self._append_text(self._step(token_ids))
        self._pending.clear()
        return self._text

    def _append_text(self, new_text: str) -> str | None:
        """Extend output_text and apply stop strings to the part that could contain one."""
        if not new_text:
            return None
        self._text += new_text
        hit = self._find_stop(len(new_text))
        if hit is None:
            return None
        stop_str, index = hit
        end = index + len(stop_str) if self.include_stop_str_in_output else index
        self._text = self._text[:end]
        self.stop_reason = stop_str
        return stop_str

    def _find_stop(self, num_new_chars: int) -> tuple[str, int] | None:
        """The earliest stop string overlapping the new text (it may start in older text)."""
        best: tuple[str, int] | None = None
        for stop_str in self.stop:
            start = max(0, len(self._text) - num_new_chars - len(stop_str) + 1)
            index = self._text.find(stop_str, start)
            if index != -1 and (best is None or index < best[1]):
                best = (stop_str, index)
        return best

    def _flush(self) -> None:
        """At the end, decode tokens still waiting for a character's last bytes (U+FFFD)."""
        if self.stop_reason is not None or self._num_emitted == len(self._ids):
            return
        start = max(0, self._num_emitted - _PROMPT_CONTEXT_TOKENS)
        context_text = self._decode(self._ids[start : self._num_emitted])
        full_text = self._decode(self._ids[start:])
        if full_text.startswith(context_text):
            tail = full_text[len(context_text) :]
        else:
            tail = self._decode(self._ids[self._num_emitted :])
        self._num_emitted = len(self._ids)
        self._append_text(tail)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: all of it (delta=False) or only the unsent part (delta=True).

        While unfinished, the last stop_buffer_length characters are held back.
        """
        text = self.output_text
        if finished:
            self._flush()
            text = self._text
        buffer_length = 0 if finished else self.stop_buffer_length
        length = max(len(text) - buffer_length, 0)
        if not delta:
            return text[:length]
        last_offset = self._last_output_offset
        if last_offset >= length:
            return ""
        self._last_output_offset = length
        return text[last_offset:length]


_TOKEN_TEXT_CACHE: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, dict[int, str]] = (
    weakref.WeakKeyDictionary()
)


def decode_token(tokenizer: PreTrainedTokenizerBase, token_id: int) -> str:
    """One token's text for logprob display (special tokens shown; partial bytes as U+FFFD).

    Cached per tokenizer because top-k logprobs decode the same few ids over and over.
    """
    try:
        cache = _TOKEN_TEXT_CACHE.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable or hashable: no cache
        return tokenizer.decode([token_id], skip_special_tokens=False)
    text = cache.get(token_id)
    if text is None:
        text = cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False)
    return text
