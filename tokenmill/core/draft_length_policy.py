"""What the scheduler asks of a speculation policy: how many drafts per request this step, and
what the steps cost. `spec_decode/policy.py` (the adaptive bandit) is the implementation; this
interface lets the scheduler use it without importing the speculative-decoding package."""

from __future__ import annotations

from typing import Protocol


class DraftLengthPolicy(Protocol):
    def choose(self, num_decodes: int) -> int:
        """Drafts per request (k, 0 = none) for a step with `num_decodes` decoding requests."""
        ...

    def observe(
        self,
        num_decodes: int,
        k: int,
        num_generated: int,
        seconds: float,
        num_prefill_tokens: int = 0,
    ) -> None:
        """A measured step; see `SpeculationPolicy.observe`."""
        ...
