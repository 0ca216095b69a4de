"""Prompt logprobs: which rows of a step score prompt tokens, and their log-probabilities
(requests asking for `prompt_logprobs`)."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.layers.sampler import gather_logprobs
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.step.runner_output import PromptLogprobs
from tokenmill.step.runner_request_state import CachedRequestState


def prompt_logprob_rows(
    states: list[CachedRequestState],
    computed: np.ndarray,
    seq_lens: np.ndarray,
    starts: np.ndarray,
) -> list[tuple[CachedRequestState, int, int]]:
    """Rows whose next token is a prompt token, for requests that want prompt logprobs."""
    rows = []
    for state, c, end, start in zip(states, computed, seq_lens, starts):
        if state.sampling_params.prompt_logprobs is None:
            continue
        count = min(int(end), state.num_prompt_tokens - 1) - int(c)
        if count > 0:
            rows.append((state, int(start), count))
    return rows


def prompt_logprobs(
    model: LlamaForCausalLM,
    hidden: torch.Tensor,
    rows: list[tuple[CachedRequestState, int, int]],
    device: torch.device,
) -> dict[str, PromptLogprobs]:
    """Raw log-probabilities of each scheduled prompt token given the tokens before it."""
    indices = torch.cat([torch.arange(start, start + count) for _, start, count in rows])
    targets = torch.tensor(
        [
            t
            for state, start, count in rows
            for t in state.token_ids[
                state.num_computed_tokens + 1 : state.num_computed_tokens + 1 + count
            ]
        ]
    )
    num_top = max(state.sampling_params.prompt_logprobs or 0 for state, _, _ in rows)
    logits = model.compute_logits(hidden[indices.to(device)])
    tensors = gather_logprobs(torch.log_softmax(logits, dim=-1), targets.to(device), num_top)
    token_ids, logprobs = tensors.token_ids.tolist(), tensors.logprobs.tolist()
    ranks = tensors.ranks.tolist()
    result, offset = {}, 0
    for state, _, count in rows:
        span = slice(offset, offset + count)
        result[state.req_id] = PromptLogprobs(
            first_position=state.num_computed_tokens + 1,
            token_ids=token_ids[span],
            logprobs=logprobs[span],
            ranks=ranks[span],
        )
        offset += count
    return result
