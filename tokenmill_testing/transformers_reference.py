"""What transformers generates for a checkpoint: the reference tokenmill's outputs are held to."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def greedy_reference(
    model: PreTrainedModel, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt's `max_tokens` greedy tokens (no early stop) and their log-probabilities
    (`[max_tokens, vocab]`, float32), one prompt at a time."""
    tokens, logprobs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            logprobs.append(torch.log_softmax(torch.cat(out.logits).float(), dim=-1))
    return tokens, logprobs
