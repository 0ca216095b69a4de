"""Grammars for the engine: compiled off the step's critical path, cached per distinct schema,
and turned into one token bitmask per step for every constrained row.

Compiles run on one background thread. A request whose grammar is still compiling waits in
the queue (`RequestGrammar.is_ready`) while the scheduler admits others; the step loop never
waits for a compile.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from tokenmill.core.scheduler_output import SchedulerOutput
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured_output import backend
from tokenmill.structured_output.bitmask import GrammarBitmask
from tokenmill.structured_output.request_grammar import RequestGrammar

if TYPE_CHECKING:
    from tokenmill.request import Request

# Distinct grammars kept compiled (least recently requested dropped first).
MAX_CACHED_GRAMMARS = 512


class StructuredOutputManager:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Iterable[int]
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._executor: ThreadPoolExecutor | None = None
        self._backend: Future[backend.XgrammarBackend] | None = None
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self._bitmask: torch.Tensor | None = None  # reused step to step, grown when needed

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise `InvalidRequestError` for an invalid schema, regex or grammar. One seen
        before (compiled, or validated by the server) is not checked again."""
        backend.validate(params)

    def request_grammar(self, params: SamplingParams) -> RequestGrammar:
        """A new matcher-to-be for one request; the compile is shared with equal schemas."""
        structured = params.structured_outputs
        assert isinstance(structured, StructuredOutputsParams)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
            # The tokenizer's token table is built once, on the same thread, before any compile.
            self._backend = self._executor.submit(
                backend.XgrammarBackend, self._tokenizer, self.vocab_size, self._stop_token_ids
            )
        assert self._backend is not None
        key = structured.cache_key()
        compiled = self._compiled.get(key)
        if compiled is None or (compiled.done() and compiled.exception() is not None):
            compiled = self._executor.submit(self._compile, structured)
            self._compiled[key] = compiled
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        stop_token_ids = sorted(params.all_stop_token_ids | set(params.stop_token_ids or ()))
        return RequestGrammar(compiled, self._backend, stop_token_ids)

    def _compile(self, params: StructuredOutputsParams):  # runs on the compile thread
        assert self._backend is not None
        return self._backend.result().compile(params)

    def wait_for_compiles(self, timeout: float) -> None:
        """Block until a pending compile finishes or `timeout` passes: for a step that had
        nothing to run, instead of spinning (and taking the GIL from the compile thread)."""
        pending = [f for f in self._compiled.values() if not f.done()]
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    @property
    def num_cached_grammars(self) -> int:
        return len(self._compiled)

    def grammar_bitmask(
        self, requests: Mapping[str, Request], scheduler_output: SchedulerOutput
    ) -> GrammarBitmask | None:
        """The allowed tokens of every constrained row this step samples: one row per sampled
        position, i.e. k + 1 for a request verifying k drafts (row j as if drafts[:j] were
        accepted; the drafts were checked against the grammar when proposed)."""
        if self._executor is None:  # no structured request yet
            return None
        spec = scheduler_output.scheduled_spec_tokens
        sampling: list[tuple[str, RequestGrammar, list[int]]] = []
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = requests[req_id]
            grammar = request.grammar
            if grammar is None or grammar.matcher is None:
                continue
            drafts = spec.get(req_id, [])
            if request.num_computed_tokens + num_new - len(drafts) == request.num_tokens:
                sampling.append((req_id, grammar, drafts))
        if not sampling:
            return None
        bitmask = self._rows(sum(len(d) + 1 for _, _, d in sampling))
        first_rows: dict[str, int] = {}
        row = 0
        for req_id, grammar, drafts in sampling:
            first_rows[req_id] = row
            row += _fill(grammar, drafts, bitmask, row)
        bitmask = bitmask[:row]
        self._mark_unsatisfiable(bitmask, first_rows, sampling)
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
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


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
