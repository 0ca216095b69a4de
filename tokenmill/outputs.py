"""What the engine hands back to callers, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """The log-probability of one token, its rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's log-probabilities: the sampled token's and the top-N, by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the `n` sequences generated for a prompt."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (seconds since the epoch) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0  # times its samples were preempted (recompute or swap)


@dataclass(frozen=True)
class RequestError:
    """Why a request ended without its answer, where the cause is the server's side (a KV
    transfer that failed), as an OpenAI error `code` and a message."""

    code: str
    message: str


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: RequestError | None = None
    extra: dict = field(default_factory=dict)
    # From a KV connector on the request's last output: where another engine finds its KV.
    kv_transfer_params: dict[str, Any] | None = None
