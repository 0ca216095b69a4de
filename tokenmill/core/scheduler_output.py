"""The value objects that cross the scheduler / model runner seam."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.metrics.stats import KVTransferRecord
from tokenmill.outputs import RequestError
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.bitmask import GrammarBitmask


@dataclass
class NewRequestData:
    """A request the runner has not seen yet, or one resumed after preemption by recompute
    (the runner dropped its state then); `token_ids` is the prompt plus any output so far."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens computed this step
    total_num_scheduled_tokens: int
    # Requests the runner must forget: finished or aborted since the last step, or preempted.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # KV copies to do before the forward, in this order: (device block, host block) pairs out
    # to the swap pool, then (host block, device block) pairs back in.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: drafts to verify this step (they are counted in
    # num_scheduled_tokens), and how many to propose for the next step.
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_spec_tokens_to_propose: int = 0
    # Structured outputs: allowed tokens of the constrained rows the runner samples.
    grammar_bitmask: GrammarBitmask | None = None
    # KV connector (tokenmill/kv_transfer/): what the worker half loads and saves this step.
    kv_connector_metadata: object | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class PromptLogprobs:
    """Log-probabilities of prompt tokens `first_position ...` given the tokens before each;
    per position the actual token first, then the top-N."""

    first_position: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass
class KVConnectorOutput:
    """What the worker half tells the scheduler half after a step: the asynchronous loads
    and sends that have ended since the last step (their blocks are the scheduler's again)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)  # loaded whole
    failed_recving: dict[str, str] = field(default_factory=dict)  # request id -> why
    transfers: list[KVTransferRecord] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (
            self.finished_sending or self.finished_recving or self.failed_recving or self.transfers
        )


@dataclass
class ModelRunnerOutput:
    """Tokens generated this step by each request whose scheduled tokens reached its end:
    one, or with speculation the accepted drafts plus one."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request, per generated token: (token ids, logprobs) with that token first, then the
    # top-N; and its rank. None when no request asked for logprobs.
    logprob_token_ids: list[list[list[int]]] | None = None
    logprobs: list[list[list[float]]] | None = None
    sampled_token_ranks: list[list[int]] | None = None
    prompt_logprobs: dict[str, PromptLogprobs] | None = None
    spec_token_ids: dict[str, list[int]] | None = None  # drafts for the next step
    propose_seconds: float = 0.0  # of this step's time, spent proposing those drafts
    # The KV connector's worker half: asynchronous loads and sends that ended.
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class EngineCoreOutput:
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
    kv_transfer_params: dict[str, Any] | None = None  # a KV connector's, on the last output
    error: RequestError | None = None  # finish_reason "error": why

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
