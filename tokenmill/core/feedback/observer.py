"""Everything the engine learns from its steps, behind one object.

The scheduler reports each plan (`planned`), the output applier what verification and the
prefills did (`verified`, `prefilled`), the engine the measured times (`ran`: the runner's
part, `stepped`: the whole step). From these the observer feeds the speculation policy its
price of k and the ITL target's cost model its samples (`loops.py`), counts prompt,
generated and draft tokens, and keeps the ring of step records the dashboard draws. The
scheduler reads none of it back but through its planning inputs (the policy's k, the cost
model's prediction); the engine's statistics read the counters.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from tokenmill.core.feedback.cost_model import StepShape, chunk_context
from tokenmill.core.feedback.loops import ItlFeedback, SpeculationFeedback
from tokenmill.core.feedback.prefill_budget import PrefillBudget, PrefillLimits
from tokenmill.core.feedback.records import StepRecord, new_step_ring
from tokenmill.core.feedback.speculation_policy import SpeculationPolicy
from tokenmill.metrics.stats import SpecDecodeStats
from tokenmill.step.request import Request
from tokenmill.step.runner_output import ModelRunnerOutput
from tokenmill.step.scheduler_output import SchedulerOutput


class StepObserver:
    def __init__(
        self,
        spec_policy: SpeculationPolicy | None = None,
        prefill_limits: PrefillLimits | None = None,
    ) -> None:
        self.spec_policy = spec_policy
        self.spec_stats = SpecDecodeStats() if spec_policy else None
        self._spec_feedback = SpeculationFeedback() if spec_policy else None
        self.prefill_limits = prefill_limits or PrefillLimits()
        self.itl_feedback = ItlFeedback.for_limits(self.prefill_limits)
        self.step_records = new_step_ring()  # the last steps, for the dashboard
        self.num_steps = 0  # that scheduled tokens
        self.step_seconds = 0.0  # wall time of those steps, since start
        self.num_generation_tokens = 0
        # Prompt tokens computed (output recomputed after a preemption counts as prompt)...
        self.num_prompt_tokens_scheduled = 0
        self.last_num_scheduled_tokens = 0
        # ...and whole prompts, each counted once when its prefill completes (as vLLM counts
        # them), with how many of those tokens came from the prefix cache.
        self.num_prompt_tokens_prefilled = 0
        self.num_cached_prompt_tokens_prefilled = 0
        self._last_plan: tuple[SchedulerOutput, int] | None = None  # with its prompt tokens

    # ---- from the scheduler and the output applier -------------------------------------------

    def planned(
        self,
        output: SchedulerOutput,
        requests: Mapping[str, Request],
        running_ids: Collection[str],
        prefill: PrefillBudget | None,
    ) -> None:
        """`schedule()` produced `output` for `requests` (as they are before the step runs):
        `running_ids` were scheduled as running requests."""
        total = output.total_num_scheduled_tokens
        num_prompt_tokens = _num_prompt_tokens(output, requests)
        self.last_num_scheduled_tokens = total
        self.num_prompt_tokens_scheduled += num_prompt_tokens
        self._last_plan = (output, num_prompt_tokens)
        if self._spec_feedback is not None:
            self._spec_feedback.planned(output, running_ids)
        if self.itl_feedback is not None and total:
            self.itl_feedback.planned(_step_shape(output, requests, running_ids), prefill)

    def verified(self, num_drafts: int, num_accepted: int) -> None:
        assert self.spec_stats is not None
        self.spec_stats.record(num_drafts, num_accepted)

    def prefilled(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A prompt's first prefill completed."""
        self.num_prompt_tokens_prefilled += num_prompt_tokens
        self.num_cached_prompt_tokens_prefilled += num_cached_tokens

    # ---- from the engine ---------------------------------------------------------------------

    def ran(self, seconds: float, output: ModelRunnerOutput) -> None:
        """The runner took `seconds` for the last planned step: the speculation policy learns
        what its decodes cost and yielded."""
        if self.spec_policy is not None and self._spec_feedback is not None:
            sample = self._spec_feedback.measure(seconds, output)
            if sample is not None:
                self.spec_policy.observe(*sample)

    def stepped(self, seconds: float, output: ModelRunnerOutput, now: float) -> None:
        """The whole last step took `seconds` (what every decoding request waited for its
        token): the ITL cost model learns from it, and a step that ran is recorded."""
        self.num_generation_tokens += sum(len(t) for t in output.sampled_token_ids)
        plan, self._last_plan = self._last_plan, None
        if plan is None or plan[0].is_empty:
            return
        scheduled, num_prefill = plan
        self.num_steps += 1
        self.step_seconds += seconds
        if self.itl_feedback is not None:
            self.itl_feedback.observe(seconds)
        self.step_records.append(
            StepRecord(
                now,
                seconds,
                num_prefill,
                scheduled.total_num_scheduled_tokens - num_prefill,
                len(scheduled.num_scheduled_tokens),
                scheduled.num_spec_tokens_to_propose,
                len(scheduled.preempted_req_ids),
            )
        )


def _num_prompt_tokens(output: SchedulerOutput, requests: Mapping[str, Request]) -> int:
    """Of the step's tokens, those before each request's prompt end."""
    total = 0
    for req_id, num_new in output.num_scheduled_tokens.items():
        request = requests[req_id]
        prompt_end = min(request.num_prompt_tokens, request.num_computed_tokens + num_new)
        total += max(0, prompt_end - request.num_computed_tokens)
    return total


def _step_shape(
    output: SchedulerOutput, requests: Mapping[str, Request], running_ids: Collection[str]
) -> StepShape:
    """What the cost model sees of the step just planned."""
    num_decode = num_prefill = num_context = 0
    for req_id, num_new in output.num_scheduled_tokens.items():
        request = requests[req_id]
        num_cached = request.num_computed_tokens
        # A decode: running, one token left (drafts are not in num_tokens).
        if req_id in running_ids and request.num_tokens - num_cached == 1:
            num_decode += num_new
        else:
            num_prefill += num_new
            num_context += chunk_context(num_new, num_cached)
    return StepShape(num_decode, num_prefill, num_context)
