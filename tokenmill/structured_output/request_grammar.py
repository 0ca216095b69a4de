"""One request's grammar: its compile (shared with requests of the same schema) and matcher.

The matcher lives with the scheduler's `Request`, not in the runner, and advances only on
tokens the scheduler appends to the output. Preemption (recompute or swap) recomputes or
copies KV but appends nothing, so the matcher's state survives it untouched.

With `reasoning_end` (a reasoning model's "</think>"), the grammar waits: tokens pass freely,
and no bitmask row is filled, until the output's text has written that end; the matcher then
starts at the next token (vLLM's `should_advance` / `should_fill_bitmask` with a reasoner).
The text is matched, not token ids, so an end tag spelled in several tokens (or in another
split than the tokenizer's own) is found as well.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar

# finish_reason "error", with this as stop_reason, when no token can continue the output.
UNSATISFIABLE = "structured output: no token of the vocabulary can continue the grammar"


class RequestGrammar:
    # Speculative decoding for constrained rows: drafts are cut at the first token the grammar
    # rejects and the rest verified (True), or constrained rows verify none (False; kept for
    # benchmarks/structured_outputs.py, which measures the two).
    speculate = True

    def __init__(
        self,
        compiled: Future[xgrammar.CompiledGrammar],
        backend: Future[Any],  # an XgrammarBackend (not imported: this is a request value)
        stop_token_ids: list[int],
        *,
        release: Callable[[], None] | None = None,
        compile_timeout: float | None = None,
        reasoning_end: str | None = None,
        token_text: Callable[[int], str] | None = None,
    ) -> None:
        """`release`: tells the manager this request no longer needs the compile (called once,
        when the request is freed); `compile_timeout`: seconds to wait for the compile before
        the request fails; `reasoning_end`: the text after which the grammar starts, read
        through `token_text` (a token id's text)."""
        self._compiled = compiled
        self._backend = backend
        self._release = release
        self._timeout = compile_timeout
        self._deadline = None if compile_timeout is None else time.monotonic() + compile_timeout
        # Every token that ends this request: allowed only where the grammar may end.
        self._stop_token_ids = stop_token_ids
        self.matcher: xgrammar.GrammarMatcher | None = None
        self.error: str | None = None  # why the grammar could not be compiled
        # Set for one step: its row (0: the next token, j: after j drafts) where no token
        # can continue the grammar.
        self.dead_row: int | None = None
        self._reasoning_end = reasoning_end
        self._token_text = token_text
        self._reasoning_tail = ""  # the output's last characters while reasoning
        assert reasoning_end is None or token_text is not None

    @property
    def in_reasoning(self) -> bool:
        """The output has not written `reasoning_end` yet: nothing is constrained."""
        return self._reasoning_end is not None

    def _ends_reasoning(self, token_id: int, tail: str) -> tuple[bool, str]:
        """Whether `token_id` after `tail` completes the end of the reasoning; the new tail."""
        assert self._reasoning_end is not None and self._token_text is not None
        tail += self._token_text(token_id)
        if self._reasoning_end in tail:
            return True, ""
        keep = len(self._reasoning_end) - 1  # enough to find an end split across tokens
        return False, tail[max(0, len(tail) - keep) :]

    def is_ready(self) -> bool:
        """Compiled (or failed to compile): the request may be scheduled. Never blocks."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self._compiled.done():
            if self._deadline is None or time.monotonic() < self._deadline:
                return False
            self.error = (
                f"structured output: the grammar did not compile within {self._timeout:g} s "
                "(structured_outputs_config compile_timeout)"
            )
            self.release()
            return True
        try:
            backend = self._backend.result()
            self.matcher = backend.matcher(self._compiled.result(), self._stop_token_ids)
        except Exception as e:
            self.error = f"structured output: the grammar could not be compiled: {e}"
        return True

    def release(self) -> None:
        """The request is done with the compile (finished, aborted or timed out): a compile
        nobody waits for any longer is cancelled if it has not started."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance past generated tokens; False if one of them breaks the grammar."""
        assert self.matcher is not None
        for index, token_id in enumerate(token_ids):
            if not self.in_reasoning:
                return all(self.matcher.accept_token(t) for t in token_ids[index:])
            ended, self._reasoning_tail = self._ends_reasoning(token_id, self._reasoning_tail)
            if ended:
                self._reasoning_end = None
        return True

    def valid_prefix(self, draft_token_ids: list[int]) -> list[int]:
        """The leading drafts the grammar allows (the matcher is left where it was)."""
        assert self.matcher is not None
        if self.in_reasoning:
            # Unconstrained, up to the draft that would end the reasoning: the rows after it
            # would need the grammar's first mask, so that draft waits for the next step.
            tail = self._reasoning_tail
            for index, token_id in enumerate(draft_token_ids):
                ended, tail = self._ends_reasoning(token_id, tail)
                if ended:
                    return draft_token_ids[:index]
            return draft_token_ids
        if not self.speculate:
            return []
        num_valid = 0
        for token_id in draft_token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            num_valid += 1
        if num_valid:
            self.matcher.rollback(num_valid)
        return draft_token_ids[:num_valid]

    @property
    def is_terminated(self) -> bool:
        return self.matcher is not None and not self.in_reasoning and self.matcher.is_terminated()
