"""Prompt-lookup (n-gram) drafts: if the last n tokens appeared earlier in the request, guess
that what followed them then follows again. Free to compute, and right surprisingly often when
an answer copies from its prompt (editing, summarising, extraction)."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.step.runner_request_state import CachedRequestState

_ITEM = array("i").itemsize


class NgramProposer:
    proposal_threads: int | None = None  # the engine's threads

    def __init__(self, min_n: int, max_n: int) -> None:
        """n-grams of `min_n` to `max_n` tokens (1 <= min_n <= max_n: SpeculativeConfig checks)."""
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, states: list[CachedRequestState], num_tokens: int) -> dict[str, list[int]]:
        proposals = {}
        for state in states:
            drafts = self.lookup(state.token_array, num_tokens)
            if drafts:
                proposals[state.req_id] = drafts
        return proposals

    def lookup(self, token_ids: array, num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts after the longest n-gram (max_n down to min_n) that ends the
        sequence and also occurs earlier in it; the latest earlier occurrence wins.

        `token_ids` is an `array('i')`, searched as bytes with `bytes.rfind` (C speed).
        """
        if num_tokens <= 0:
            return []
        haystack = token_ids.tobytes()
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            needle = haystack[(length - n) * _ITEM :]
            # Occurrences must end before the last token, so at least one token follows them.
            end = (length - 1) * _ITEM
            while (found := haystack.rfind(needle, 0, end)) >= 0:
                if found % _ITEM == 0:  # starts on a token boundary
                    start = found // _ITEM + n
                    return token_ids[start : start + num_tokens].tolist()
                end = found + len(needle) - 1  # look for one starting before `found`
        return []
