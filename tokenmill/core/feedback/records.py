"""What each engine step did, kept for the last few thousand steps (the dashboard's strip).

Every field is a number the step already has at hand: nothing is computed for the record
that the step did not compute anyway.
"""

from __future__ import annotations

from typing import NamedTuple

from tokenmill.metrics.ring import Ring

# Steps kept: minutes of history at the tens of steps per second a busy server makes.
STEP_HISTORY = 8192


class StepRecord(NamedTuple):
    """One step that scheduled tokens. A tuple, so a batch of them serialises as arrays."""

    time: float  # wall clock (time.time()) when the step ended
    seconds: float  # the step's duration
    num_prefill_tokens: int  # prompt tokens computed (a prompt recomputed after preemption too)
    num_decode_tokens: int  # the rest of the step's tokens: decodes and their drafts
    num_reqs: int  # requests in the batch
    num_spec_tokens: int  # drafts per request the speculation policy chose to propose (k)
    num_preempted: int  # requests preempted by this step's scheduling


def new_step_ring() -> Ring[StepRecord]:
    return Ring(STEP_HISTORY)
