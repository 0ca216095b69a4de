"""How much catch-up a proposer with its own KV (draft model, EAGLE) may do in one step.

Such a proposer runs lazily over the positions it has not seen when asked to draft. After
steps without drafts (the adaptive policy at k = 0, then exploring k >= 1) every running
request is behind, and catching all of them up at once would cost more than the step it
drafts for. So a step gets the steady state's tokens (k + 1 per request: the accepted drafts
and the bonus token) plus a fixed extra, shared smallest gap first; a request whose gap does
not fit is brought part of the way and drafts a step or a few later.
"""

from __future__ import annotations


def catch_up_allowances(gaps: list[int], num_tokens: int, extra_tokens: int) -> list[int]:
    """Per request (in the order of `gaps`, the positions each is behind), how many of them
    it may catch up on this step when drafting `num_tokens` tokens."""
    budget = extra_tokens + (num_tokens + 1) * len(gaps)
    allowances = [0] * len(gaps)
    for i in sorted(range(len(gaps)), key=gaps.__getitem__):
        allowances[i] = min(gaps[i], budget)
        budget -= allowances[i]
    return allowances
