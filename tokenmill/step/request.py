"""A request as the scheduler sees it: tokens, progress and status, no tensors."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.lora.peft_adapter import PeftAdapter
    from tokenmill.structured_output.request_grammar import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Admitted with blocks for KV a connector loads asynchronously; computes once it arrives.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI `finish_reason` for a finished status."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence being generated: one sample of an engine request.

    It is known by its `sample_id` (the engine request's id when it asks for one sample,
    `{index}_{request_id}` for each of `n` > 1: `engine/intake.py`'s `sample_id`); every
    `req_id` of the step's values (`SchedulerOutput`, `ModelRunnerOutput`,
    `RequestStepOutput`) is this id.

    Its tokens are laid out as::

        | prompt_token_ids | output_token_ids |
        |<-- num_computed_tokens -->|          (KV already in the cache)
                                    |<- new ->| scheduled this step

    Preemption by recompute sets `num_computed_tokens` back to 0; prefix-cache hits start it
    above 0; a chunked prefill is a step whose new tokens stop short of `num_tokens`.
    """

    def __init__(
        self,
        sample_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        grammar: RequestGrammar | None = None,
        lora: PeftAdapter | None = None,
    ) -> None:
        self.sample_id = sample_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved: never past max_model_len
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority  # lower runs first, as in vLLM
        self.cache_salt = cache_salt  # isolates this tenant's prefix-cache entries
        self.block_hashes: list[bytes] = []  # of full blocks, filled by the KV cache manager
        self.num_skips = 0  # times cache-aware admission passed it over at the queue head
        self.spec_token_ids: list[int] = []  # drafts proposed for the next step
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache, once scheduled
        self.first_scheduled_time: float | None = None
        self.grammar = grammar  # structured outputs: the matcher its output must follow
        self.lora = lora  # the LoRA adapter it runs with; None: the base model

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        """What a KV connector needs to know of this request beyond its tokens (vLLM's
        `kv_transfer_params`, carried in `SamplingParams.extra_args`): where its KV was
        computed, or that its KV is to be handed to another engine."""
        extra = self.sampling_params.extra_args
        return None if extra is None else extra.get("kv_transfer_params")

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model (as vLLM's `lora_int_id`)."""
        return 0 if self.lora is None else self.lora.lora_int_id

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.sample_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
