"""What a draft proposer offers the model runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenmill.worker.request_state import CachedRequestState


class Proposer(Protocol):
    def propose(self, states: list[CachedRequestState], num_tokens: int) -> dict[str, list[int]]:
        """Up to `num_tokens` drafts per request, to follow its last (verified) token."""
        ...
