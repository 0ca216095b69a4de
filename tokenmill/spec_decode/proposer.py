"""What a draft proposer offers the model runner."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from tokenmill.step.runner_request_state import CachedRequestState

# A draft of at most this many weight elements (with the LM head it scores with) proposes on
# one torch thread: its ops are one row each, microseconds of work, and waking torch's OpenMP
# team for each costs more; on shared cores a team waits for a descheduled peer at every op
# (EAGLE on the demo target, k = 4, load ~8 on 2 vCPUs: 7 tok/s on 2 threads, 57 on one).
SMALL_DRAFT_ELEMENTS = 1 << 24


def proposal_threads(weight_elements: int) -> int | None:
    """The torch threads a draft of `weight_elements` proposes on (None: the engine's)."""
    return 1 if weight_elements <= SMALL_DRAFT_ELEMENTS else None


def threads_for(proposer: Proposer) -> AbstractContextManager[None]:
    """Run a proposal on the proposer's `proposal_threads` torch threads (None: as is)."""
    return torch_threads(proposer.proposal_threads)


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Torch's (and so the native kernels') thread count set to `threads` within (None: as is)."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Proposer(Protocol):
    # Torch threads its proposals run on (`proposal_threads()`); None: the engine's.
    proposal_threads: int | None

    def propose(self, states: list[CachedRequestState], num_tokens: int) -> dict[str, list[int]]:
        """Up to `num_tokens` drafts per request, to follow its last (verified) token."""
        ...


@runtime_checkable
class RequestTrackingProposer(Proposer, Protocol):
    """A proposer that keeps per-request state of its own (suffix decoding): the runner tells
    it which requests it forgot at each step."""

    def release(self, finished_req_ids: set[str], preempted_req_ids: set[str]) -> None: ...


@runtime_checkable
class HiddenStateProposer(Proposer, Protocol):
    """A proposer that drafts from the target's hidden states (EAGLE, Medusa): the runner
    hands it, after each step, the rows of every token the target verified."""

    def record_hidden_states(
        self, state: CachedRequestState, first_position: int, hidden: torch.Tensor
    ) -> None:
        """The target's last hidden states at positions first_position, first_position + 1,
        ... of the request (post-norm, as the LM head takes them)."""
        ...
