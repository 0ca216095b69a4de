"""Grammars for the engine: compiled off the step's critical path, cached per distinct schema,
and turned into one token bitmask per step for every constrained row.

Compiles run on two background threads: one for small constraints (up to
`SMALL_CONSTRAINT_BYTES`) and one for the rest, so one tenant's large schema never queues
another's three-token regex. A request whose grammar is still compiling waits in the queue
(`RequestGrammar.is_ready`) while the scheduler admits others; the step loop never waits for
a compile. A compile nobody waits for any more (its requests aborted or timed out) is
cancelled if it has not started; xgrammar cannot stop one that has, which is why
`max_schema_bytes` bounds how long one can take. Compiled grammars are kept within
`cache_max_bytes` (xgrammar's own size of each), least recently requested dropped first.

Thread safety: the server holds compiles from the event loop's thread (so that a slow one is
a 400 before any output), the engine from its own; `_lock` guards the cache.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from tokenmill.config import StructuredOutputsConfig
from tokenmill.sampling_params import (
    InvalidRequestError,
    SamplingParams,
    StructuredOutputsParams,
)
from tokenmill.structured_output import backend
from tokenmill.structured_output.bitmask import GrammarBitmask
from tokenmill.structured_output.request_grammar import RequestGrammar

# Distinct grammars kept compiled, at most (the byte budget usually binds first).
MAX_CACHED_GRAMMARS = 512
# Constraints this small compile on their own thread, never behind a large one.
SMALL_CONSTRAINT_BYTES = 4096


@dataclass
class _Compile:
    """One distinct grammar: its compile, who waits for it, its size once compiled."""

    future: Future
    num_holders: int = 0
    num_bytes: int = 0  # xgrammar's memory_size_bytes, once compiled
    cached: bool = True  # still in the cache (eviction leaves holders their future)


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        config: StructuredOutputsConfig | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self.config = config or StructuredOutputsConfig()
        # Re-entrant: a future's done callback runs at once where it completes or is cancelled.
        self._lock = threading.RLock()
        self._executors: dict[bool, ThreadPoolExecutor] = {}  # by "is small"
        self._backend: Future[backend.XgrammarBackend] | None = None
        self._compiles: OrderedDict[tuple, _Compile] = OrderedDict()
        self._cached_bytes = 0
        self._bitmask: torch.Tensor | None = None  # reused step to step, grown when needed

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise `InvalidRequestError` for a schema, regex or grammar that is too large or
        invalid. One seen before (compiled, or validated by the server) is not checked
        again. Safe on any thread."""
        num_bytes = _constraint_bytes(params)
        if num_bytes > self.config.max_schema_bytes:
            raise InvalidRequestError(
                params.param,
                f"is {num_bytes} bytes as JSON text; this server compiles at most "
                f"{self.config.max_schema_bytes} (structured_outputs_config max_schema_bytes)",
            )
        backend.validate(params)

    def hold(self, params: StructuredOutputsParams) -> tuple[Future, Callable[[], None]]:
        """The compile of `params` (shared with equal constraints, started if new) and the
        function to call once when no longer waiting for it. Safe on any thread."""
        params = self._effective(params)
        key = params.cache_key()
        with self._lock:
            if self._backend is None:
                self._start()
            entry = self._compiles.get(key)
            failed = entry is not None and entry.future.done() and not _succeeded(entry.future)
            if entry is not None and failed:
                self._uncache(key, entry)
            if entry is None or failed:
                entry = _Compile(self._submit(params))
                self._compiles[key] = entry
                entry.future.add_done_callback(functools.partial(self._compiled, key, entry))
            self._compiles.move_to_end(key)
            entry.num_holders += 1
        return entry.future, functools.partial(self._release, key, entry)

    def request_grammar(self, params: SamplingParams) -> RequestGrammar:
        """A new matcher-to-be for one request; the compile is shared with equal schemas."""
        structured = params.structured_outputs
        assert isinstance(structured, StructuredOutputsParams)
        compiled, release = self.hold(structured)
        assert self._backend is not None
        stop_token_ids = sorted(params.all_stop_token_ids | set(params.stop_token_ids or ()))
        return RequestGrammar(
            compiled,
            self._backend,
            stop_token_ids,
            release=release,
            compile_timeout=self.config.compile_timeout,
        )

    def _effective(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """The constraint as compiled: the server's `disable_any_whitespace` applies to all."""
        if self.config.disable_any_whitespace and not params.disable_any_whitespace:
            return StructuredOutputsParams(
                **{**vars(params), "disable_any_whitespace": True}  # same param, compacted
            )
        return params

    def _start(self) -> None:  # under the lock
        self._executors = {
            small: ThreadPoolExecutor(1, thread_name_prefix=f"grammar-compile-{name}")
            for small, name in ((True, "small"), (False, "large"))
        }
        # The tokenizer's token table is built once, before any compile.
        self._backend = self._executors[True].submit(
            backend.XgrammarBackend,
            self._tokenizer,
            self.vocab_size,
            self._stop_token_ids,
            self.config.max_whitespace,
        )

    def _submit(self, params: StructuredOutputsParams) -> Future:
        small = _constraint_bytes(params) <= SMALL_CONSTRAINT_BYTES
        return self._executors[small].submit(self._compile, params)

    def _compile(self, params: StructuredOutputsParams) -> Any:  # on a compile thread
        assert self._backend is not None
        return self._backend.result().compile(params)

    def _release(self, key: tuple, entry: _Compile) -> None:
        with self._lock:
            entry.num_holders -= 1
            if entry.num_holders == 0 and entry.future.cancel():  # not started yet
                self._uncache(key, entry)

    def _compiled(self, key: tuple, entry: _Compile, future: Future) -> None:
        """Count a finished compile's bytes, then drop the least recently requested grammars
        until the cache fits its budget (pending compiles stay: they take no memory yet)."""
        with self._lock:
            if not entry.cached or not _succeeded(future):
                return
            entry.num_bytes = int(future.result().memory_size_bytes)
            self._cached_bytes += entry.num_bytes
            for old_key, old in list(self._compiles.items()):
                if (
                    self._cached_bytes <= self.config.cache_max_bytes
                    and len(self._compiles) <= MAX_CACHED_GRAMMARS
                ):
                    break
                if old.future.done():
                    self._uncache(old_key, old)

    def _uncache(self, key: tuple, entry: _Compile) -> None:  # under the lock
        if entry.cached and self._compiles.get(key) is entry:
            del self._compiles[key]
            entry.cached = False
            self._cached_bytes -= entry.num_bytes

    def wait_for_compiles(self, timeout: float) -> None:
        """Block until a pending compile finishes or `timeout` passes: for a step that had
        nothing to run, instead of spinning (and taking the GIL from the compile thread)."""
        with self._lock:
            pending = [e.future for e in self._compiles.values() if not e.future.done()]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    @property
    def num_cached_grammars(self) -> int:
        return len(self._compiles)

    @property
    def cached_grammar_bytes(self) -> int:
        """xgrammar's size of the compiled grammars kept."""
        return self._cached_bytes

    def grammar_bitmask(
        self, sampling: Mapping[str, tuple[RequestGrammar, list[int]]]
    ) -> GrammarBitmask | None:
        """The allowed tokens of every constrained row this step samples: one row per sampled
        position, i.e. k + 1 for a request verifying k drafts (row j as if drafts[:j] were
        accepted; the drafts were checked against the grammar when proposed). `sampling`: the
        grammar and drafts of each request that samples this step (the scheduler knows)."""
        if self._backend is None:  # no structured request yet
            return None
        rows = [(r, g, d) for r, (g, d) in sampling.items() if g.matcher is not None]
        if not rows:
            return None
        bitmask = self._rows(sum(len(d) + 1 for _, _, d in rows))
        first_rows: dict[str, int] = {}
        row = 0
        for req_id, grammar, drafts in rows:
            first_rows[req_id] = row
            row += _fill(grammar, drafts, bitmask, row)
        bitmask = bitmask[:row]
        self._mark_unsatisfiable(bitmask, first_rows, rows)
        return GrammarBitmask(bitmask, first_rows)

    def _rows(self, num_rows: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            import xgrammar as xgr

            size = max(num_rows, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]))
            self._bitmask = xgr.allocate_token_bitmask(size, self.vocab_size)
        return self._bitmask

    @staticmethod
    def _mark_unsatisfiable(
        bitmask: torch.Tensor,
        first_rows: dict[str, int],
        sampling: list[tuple[str, RequestGrammar, list[int]]],
    ) -> None:
        """A row allowing no token would leave nothing to sample. Its request's first such
        row is noted (`RequestGrammar.dead_row`): the scheduler finishes the request
        (finish_reason "error") if verification reaches that row, i.e. accepts the drafts
        leading into the dead end; a rejected draft leaves it running, as without drafts.
        That row and the ones after it are left unmasked meanwhile."""
        empty = ~bitmask.numpy().any(axis=1)  # numpy: a torch op costs more on 32 x 64 ints
        if not empty.any():
            return
        for req_id, grammar, drafts in sampling:
            first = first_rows[req_id]
            dead = empty[first : first + len(drafts) + 1].nonzero()[0]
            if len(dead):
                grammar.dead_row = int(dead[0])
                bitmask[first + grammar.dead_row : first + len(drafts) + 1] = -1

    def shutdown(self) -> None:
        """Cancel the compiles not started; one running ends on its own (a daemon-less thread
        that would otherwise keep the interpreter from exiting until it has)."""
        for executor in self._executors.values():
            executor.shutdown(wait=False, cancel_futures=True)


def _constraint_bytes(params: StructuredOutputsParams) -> int:
    return len(params.cache_key()[1].encode())


def _succeeded(future: Future) -> bool:
    return not future.cancelled() and future.exception() is None


def _fill(grammar: RequestGrammar, drafts: list[int], bitmask: torch.Tensor, row: int) -> int:
    """Fill rows for the next token and after each draft; leave the matcher where it was.

    A drafted stop token that ends the grammar ends the request if verified: the row after
    it is never sampled from, and a terminated matcher has no mask to give, so it allows
    every token."""
    matcher = grammar.matcher
    assert matcher is not None
    for j, token_id in enumerate(drafts):
        matcher.fill_next_token_bitmask(bitmask, row + j)
        matcher.accept_token(token_id)
    if matcher.is_terminated():
        bitmask[row + len(drafts)] = -1
    else:
        matcher.fill_next_token_bitmask(bitmask, row + len(drafts))
    if drafts:
        matcher.rollback(len(drafts))
    return len(drafts) + 1
