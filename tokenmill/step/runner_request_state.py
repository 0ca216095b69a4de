"""The runner's per-request state, which proposers read too (kept apart from the runner so
that spec_decode need not import it)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from tokenmill.lora.peft_adapter import PeftAdapter


@dataclass
class CachedRequestState:
    """What the runner remembers of a request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + output so far, including tokens this runner sampled
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Positions whose KV the draft model has computed (speculative decoding; see draft_model).
    num_draft_computed_tokens: int = 0
    # The draft model's last chain: its first position and the tokens it fed from there, whose
    # KV the draft wrote (those the target accepts need no catch-up; see draft_model).
    draft_fed: tuple[int, list[int]] | None = None
    # The target's hidden states (first position, rows) not yet consumed by a proposer that
    # drafts from them (EAGLE, Medusa; see spec_decode/eagle.py).
    draft_hidden: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # The same tokens as a C array, for n-gram lookups (bytes.rfind) without conversion.
    token_array: array = field(default_factory=lambda: array("i"))
    lora: PeftAdapter | None = None  # its LoRA adapter; None: the base model
    # A hybrid model's other KV groups' block tables (layers/kv_groups.py), group 1 first.
    group_block_ids: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.token_array = array("i", self.token_ids)

    def append(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)
        self.token_array.extend(token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
