"""What the step observer (observer.py) learns from a step once its time is measured.

The engine times each step after `schedule()` has planned it, so what a plan was must wait
for its time: `SpeculationFeedback` keeps what the speculation policy needs to price a
draft length k, `ItlFeedback` what the ITL target's step cost model needs. Both see only the
scheduler's output and the measured seconds.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tokenmill.core.feedback.cost_model import CostModel, StepShape
from tokenmill.core.feedback.prefill_budget import PrefillBudget, PrefillLimits
from tokenmill.metrics.stats import ItlTargetStats
from tokenmill.step.runner_output import ModelRunnerOutput
from tokenmill.step.scheduler_output import SchedulerOutput

# (decoding requests, drafts per request, tokens they generated, seconds, prompt tokens):
# the arguments of `SpeculationPolicy.observe`.
PolicySample = tuple[int, int, int, float, int]


@dataclass
class _MeasuredStep:
    """What the speculation policy learns from a step once its time is known."""

    decode_ids: set[str]  # requests decoding (one known token, plus drafts to verify)
    k: int  # drafts per request verified
    num_prefill_tokens: int  # the step's other tokens: prompt chunks


class SpeculationFeedback:
    """A step's decodes are charged verifying their drafts (the step, less the proposing it
    did for the next step) plus proposing them (in the step before). Charging a step its own
    proposing instead would bill the drafts of the next step's k to this step's k, and make
    switching to k = 0 look slow."""

    def __init__(self) -> None:
        self._last_step: _MeasuredStep | None = None
        self._last_propose_seconds = 0.0  # what the last step spent proposing drafts
        self._last_num_to_propose = 0  # the drafts per request the last step asked for

    def planned(self, output: SchedulerOutput, running_ids: Collection[str]) -> None:
        """`schedule()` produced `output`; `running_ids` were scheduled as running requests."""
        spec_tokens = output.scheduled_spec_tokens
        # Decoding requests: one known token (plus drafts) each; the rest is prefill.
        decode_ids = {
            r
            for r, n in output.num_scheduled_tokens.items()
            if r in running_ids and n - len(spec_tokens.get(r, ())) == 1
        }
        num_decode_tokens = sum(output.num_scheduled_tokens[r] for r in decode_ids)
        # The k measured is the drafts this step really verifies (the previous step's choice,
        # or fewer where the proposer found fewer). Where it found none (every request still
        # catching up, no n-gram match) the k asked for is billed: its proposing cost that k.
        k = max((len(d) for d in spec_tokens.values()), default=0) or self._last_num_to_propose
        num_prefill = output.total_num_scheduled_tokens - num_decode_tokens
        self._last_step = _MeasuredStep(decode_ids, k, num_prefill)
        self._last_num_to_propose = output.num_spec_tokens_to_propose

    def measure(self, seconds: float, output: ModelRunnerOutput) -> PolicySample | None:
        """The last planned step took `seconds` and produced `output`."""
        step = self._last_step
        if step is None:
            return None
        cost = seconds - output.propose_seconds + self._last_propose_seconds
        self._last_propose_seconds = output.propose_seconds
        num_generated = sum(
            len(tokens)
            for req_id, tokens in zip(output.req_ids, output.sampled_token_ids)
            if req_id in step.decode_ids
        )
        return len(step.decode_ids), step.k, num_generated, cost, step.num_prefill_tokens


class ItlFeedback:
    """The ITL target's side: each step's shape waits for its measured time to feed the cost
    model and the prediction error; steps over the target and the prefill granted are
    counted."""

    def __init__(self, limits: PrefillLimits, model: CostModel, target: float) -> None:
        self.limits = limits
        self.model = model
        self.stats = ItlTargetStats(target)
        self._last_shape: StepShape | None = None

    @classmethod
    def for_limits(cls, limits: PrefillLimits) -> ItlFeedback | None:
        """Feedback for `limits`, or None without an ITL target."""
        if limits.itl_target is None:
            return None
        assert limits.cost_model is not None
        return cls(limits, limits.cost_model, limits.itl_target)

    def planned(self, shape: StepShape, prefill: PrefillBudget | None) -> None:
        self._last_shape = shape
        if prefill is not None and prefill.wanted:
            self.stats.record_budget(prefill.num_granted)

    def observe(self, seconds: float) -> None:
        shape, self._last_shape = self._last_shape, None
        if shape is None:
            return
        model = self.model
        if shape.num_prefill_tokens:
            self.limits.prediction_error.observe(model.predict(shape), seconds)
        model.observe(shape, seconds)
        if seconds > self.limits.itl_target:
            self.stats.num_steps_over_target += 1
