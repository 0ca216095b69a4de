"""What the model runner hands back after a step: the tokens each request sampled."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PromptLogprobs:
    """Log-probabilities of prompt tokens `first_position ...` given the tokens before each;
    per position the actual token first, then the top-N."""

    first_position: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


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
