"""Suffix decoding (vLLM's `"method": "suffix"`, Arctic Inference's SuffixDecoding): drafts
from two suffix tries, no model. One per request over its prompt and what it has generated
so far; one shared over the outputs of the last `max_cached_requests` finished requests (what
agents, retries and templated answers repeat across requests). Each step the end of the
request is matched in both, and the chain with the higher expected acceptance wins; the chain
is longer the longer the match (`max_spec_factor`) and stops where the estimated probability
falls below `min_token_prob`, so a step speculates many tokens only where text repeats."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.spec_decode.suffix_index import SuffixIndex

if TYPE_CHECKING:
    from tokenmill.step.runner_request_state import CachedRequestState


@dataclass
class _Local:
    state: CachedRequestState
    index: SuffixIndex


class SuffixDecodingProposer:
    proposal_threads: int | None = None  # the engine's threads

    def __init__(
        self,
        max_tree_depth: int,
        max_cached_requests: int,
        max_spec_factor: float,
        min_token_prob: float,
    ) -> None:
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._local: dict[str, _Local] = {}
        self.global_index = SuffixIndex(max_tree_depth)
        self._cached_outputs: OrderedDict[str, list[int]] = OrderedDict()

    def propose(self, states: list[CachedRequestState], num_tokens: int) -> dict[str, list[int]]:
        proposals = {}
        for state in states:
            local = self._synced_local(state)
            draft = local.index.speculate_own(
                0, num_tokens, self.max_spec_factor, self.min_token_prob
            )
            shared = self.global_index.speculate(
                state.token_ids, num_tokens, self.max_spec_factor, self.min_token_prob
            )
            if shared.score > draft.score:
                draft = shared
            if draft.token_ids:
                proposals[state.req_id] = draft.token_ids
        return proposals

    def release(self, finished_req_ids: set[str], preempted_req_ids: set[str]) -> None:
        """The runner forgets these requests: drop their tries; a finished one's output goes
        to the shared cache (a preempted one comes back with its tokens and is re-indexed)."""
        for req_id in finished_req_ids | preempted_req_ids:
            local = self._local.pop(req_id, None)
            if local is not None and req_id in finished_req_ids:
                self._cache_output(req_id, local.state.output_token_ids)

    def _synced_local(self, state: CachedRequestState) -> _Local:
        """The request's trie, extended by the tokens it gained since the last step."""
        local = self._local.get(state.req_id)
        if local is None or local.state is not state:  # new, or resumed under a new state
            local = self._local[state.req_id] = _Local(state, SuffixIndex(self.max_tree_depth))
        indexed = local.index.sequence_length(0)
        if indexed < len(state.token_ids):
            local.index.extend(0, state.token_ids[indexed:])
        return local

    def _cache_output(self, req_id: str, output: list[int]) -> None:
        if self.max_cached_requests <= 0 or not output:
            return
        if req_id in self._cached_outputs:  # a sample id reused: replace the old output
            self.global_index.remove(req_id, self._cached_outputs.pop(req_id))
        self._cached_outputs[req_id] = output
        self.global_index.extend(req_id, output)
        while len(self._cached_outputs) > self.max_cached_requests:
            oldest, tokens = self._cached_outputs.popitem(last=False)
            self.global_index.remove(oldest, tokens)
