"""What a draft proposer offers the model runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from tokenmill.step.runner_request_state import CachedRequestState


class Proposer(Protocol):
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
