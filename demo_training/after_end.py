"""Training rows for the speculative heads that go on past a document's end, as the target does.

A request with `ignore_eos` keeps decoding after the reply's `<|im_end|>` (or a story's
`</s>`): the demo target then mostly repeats `<|im_end|>`, now and then with a stray word or
number between. Packed corpus rows never show that (the next document starts there), so heads
trained on them draft badly there. Here a seeded share of the documents is extended with the
target's own greedy continuation past the end, which becomes learned text like the reply.
"""

from __future__ import annotations

import random
from collections import defaultdict

import torch
import transformers

from demo_training.data import EncodedDoc

DOCS_PER_CHUNK = 512  # documents tokenized (and continued) at a time: few are left unpacked
_BATCH = 64  # sequences of one length decoded together


@torch.no_grad()
def greedy_continuations(
    target: transformers.LlamaForCausalLM, sequences: list[list[int]], num_tokens: int
) -> list[list[int]]:
    """The target's next `num_tokens` greedy tokens after each sequence, end tokens not
    stopping it. Sequences of equal length run as one batch (no padding or masks to get
    wrong)."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, sequence in enumerate(sequences):
        by_length[len(sequence)].append(i)
    out: list[list[int]] = [[] for _ in sequences]
    for length in sorted(by_length):
        members = by_length[length]
        for first in range(0, len(members), _BATCH):
            batch = members[first : first + _BATCH]
            ids, cache, new = torch.tensor([sequences[i] for i in batch]), None, []
            for _ in range(num_tokens):
                step = target(ids, cache=cache, use_cache=True, logits_to_keep=1)
                cache, ids = step.cache, step.logits[:, -1].argmax(-1, keepdim=True)
                new.append(ids)
            for i, tokens in zip(batch, torch.cat(new, dim=1).tolist()):
                out[i] = tokens
    return out


def continue_past_end(
    target: transformers.LlamaForCausalLM,
    docs: list[EncodedDoc],
    rng: random.Random,
    fraction: float,
    num_tokens: int,
    max_len: int,
) -> list[EncodedDoc]:
    """`docs` with a `fraction` of them (drawn from `rng`) extended by the target's greedy
    continuation, `num_tokens` long or up to `max_len` tokens in all."""
    chosen = [i for i, doc in enumerate(docs) if rng.random() < fraction]
    chosen = [i for i in chosen if len(docs[i].token_ids) < max_len]
    tails = greedy_continuations(target, [docs[i].token_ids for i in chosen], num_tokens)
    out = list(docs)
    for i, tail in zip(chosen, tails):
        doc = docs[i]
        room = max_len - len(doc.token_ids)
        out[i] = EncodedDoc(doc.token_ids + tail[:room], doc.num_context, doc.task_index)
    return out


def after_end_mask(labels: torch.Tensor, pos: torch.Tensor, end_ids: list[int]) -> torch.Tensor:
    """`[L]` bool for one packed row: token p comes after a learned end token of its own
    document (the continuation past the end). The prompt's own `<|im_end|>`s are not learned."""
    ended = torch.isin(labels, torch.tensor(end_ids)).long()
    before = ended.cumsum(0) - ended  # learned end tokens strictly before p, in the row
    index = torch.arange(labels.shape[0])
    doc_start = torch.where(pos == 0, index, 0).cummax(0).values
    return before - before[doc_start] > 0
