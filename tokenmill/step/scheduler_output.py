"""What the scheduler hands the model runner each step: who runs, how many tokens each, which
blocks, what to copy, what to verify."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.bitmask import GrammarBitmask

if TYPE_CHECKING:
    from tokenmill.lora.peft_adapter import PeftAdapter


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
    lora: PeftAdapter | None = None  # its LoRA adapter; None: the base model


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
    # A hybrid model's other KV groups: per request, each group's block ids added this step
    # (its whole tables where it came to hold blocks again); core/kv/window_groups.py.
    kv_group_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
