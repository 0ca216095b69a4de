"""What one step did for one request: the value the output processor turns into a
`RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.step.runner_output import PromptLogprobs


@dataclass
class RequestStepOutput:
    """What one step did for one request."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprob_token_ids: list[list[int]] | None = None
    new_logprobs: list[list[float]] | None = None
    new_sampled_token_ranks: list[int] | None = None
    new_prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    num_preemptions: int = 0  # of this request so far

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
