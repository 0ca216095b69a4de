"""Vectorised sampler: a batch of logits -> one token per row, plus raw log-probabilities.

Processing order follows vLLM v1: logit bias and min_tokens masking, then penalties; greedy rows
take the argmax, random rows go through temperature, top-k, top-p, min-p and an exponential race
(Gumbel-max equivalent). Log-probabilities come from the raw logits ("raw_logprobs").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from tokenmill.kernels.argmax import argmax_rows
from tokenmill.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")


@dataclass
class PenaltyMetadata:
    """Penalty inputs for the P rows that use any penalty, so other rows pay nothing."""

    rows: torch.Tensor | None  # [P] long batch indices; None when every row has penalties
    output_counts: torch.Tensor  # [P, V] float32: occurrences of each token in the output
    presence: torch.Tensor  # [P, 1] float32
    frequency: torch.Tensor  # [P, 1] float32
    repetition: torch.Tensor | None  # [P, 1] float32; None when no row has one != 1
    seen_mask: torch.Tensor | None  # [P, V] bool: token in prompt or output; None with repetition


@dataclass
class SamplingMetadata:
    """Per-step sampling tensors, built once per step so the sampler itself is pure tensor math.

    Optional fields are None when no row needs them, so the common path skips that work.
    """

    temperature: torch.Tensor | None  # [B] float32; greedy rows hold 1.0; None if all greedy
    greedy_mask: torch.Tensor | None  # [B] bool; None unless greedy and random rows mix
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] long in [1, V]; unlimited rows hold V
    max_top_k: int  # max of top_k (0 when top_k is None); sizes the topk-only fast path
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    penalties: PenaltyMetadata | None
    seeds: list[int | None]  # per row; None draws from the engine-wide generator
    output_positions: list[int]  # per row: len(output so far), which seeded noise is keyed on
    seeded_rows: list[int]  # random (non-greedy) rows that have a seed
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) -> -inf
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, ids, values)
    max_num_logprobs: int | None
    vocab_size: int

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        device: torch.device,
        vocab_size: int,
    ) -> SamplingMetadata:
        """Gather the batch's parameters into tensors on `device` (one pass per field group)."""
        if not len(params) == len(prompt_token_ids) == len(output_token_ids):
            raise ValueError("params, prompt_token_ids and output_token_ids differ in length")
        temperature, greedy_mask, all_greedy, all_random = _temperature_fields(params, device)
        random_params = [p for p in params if not p.is_greedy]
        top_k, max_top_k = _top_k_field(params, random_params, vocab_size, device)
        seeds = [p.seed for p in params]
        requested = [p.logprobs for p in params if p.logprobs is not None]
        prompts, outputs = prompt_token_ids, output_token_ids
        return cls(
            temperature=temperature,
            greedy_mask=greedy_mask,
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=_float_field(params, random_params, "top_p", 1.0, device),
            min_p=_float_field(params, random_params, "min_p", 0.0, device),
            penalties=_penalty_fields(params, prompts, outputs, vocab_size, device),
            seeds=seeds,
            output_positions=[len(out) for out in outputs],
            seeded_rows=[i for i, p in enumerate(params) if p.seed is not None and not p.is_greedy],
            min_tokens_mask=_min_tokens_field(params, outputs, vocab_size, device),
            logit_bias=_logit_bias_field(params, vocab_size, device),
            max_num_logprobs=max(requested) if requested else None,
            vocab_size=vocab_size,
        )


@dataclass
class LogprobsTensors:
    """Column 0 is the sampled token, columns 1..k the top-k tokens by raw log-probability."""

    token_ids: torch.Tensor  # [B, k + 1] long
    logprobs: torch.Tensor  # [B, k + 1] float32
    ranks: torch.Tensor  # [B] long: 1 + number of tokens strictly more likely than the sampled one


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] long
    logprobs: LogprobsTensors | None


class Sampler(torch.nn.Module):
    """Samples one token per row; unseeded rows share `generator` (engine-wide, reproducible)."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.generator = generator
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        sampled = self._sample(process_logits(logits, metadata), metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs or 0)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        greedy = None if md.all_random else argmax_rows(logits)
        if md.all_greedy:
            assert greedy is not None
            return greedy
        sampled = self._exponential_race(random_probs(logits, md), md)
        if md.greedy_mask is not None:
            assert greedy is not None
            sampled = torch.where(md.greedy_mask, greedy, sampled)
        return sampled

    def _exponential_race(self, probs: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """argmax(probs / q), q ~ Exp(1): an exact draw from `probs` without a cumsum search."""
        q = torch.empty_like(probs)
        if len(md.seeded_rows) < probs.shape[0]:
            q.exponential_(generator=self.generator)
        if md.seeded_rows:
            gen = self._seeded_generator(probs.device)
            for row in md.seeded_rows:
                seed = md.seeds[row]
                assert seed is not None
                gen.manual_seed(mix_seed(seed, md.output_positions[row]))
                q[row].exponential_(generator=gen)
        # A q of exactly 0 would turn a zero-probability token into 0/0 = NaN, which argmax picks.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        return probs.div_(q).argmax(dim=-1)

    def _seeded_generator(self, device: torch.device) -> torch.Generator:
        """One reusable generator per device, re-seeded per row (cheaper than a new one each)."""
        gen = self._seeded_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            self._seeded_generators[device] = gen
        return gen


def takes_argmax(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether the sampler's token for a row is the plain argmax of its logits: greedy, and
    nothing that `SamplingMetadata` gathers applies (logprobs, penalties, logit bias, a
    min_tokens ban). A step of only such rows skips building the metadata (`greedy_tokens`)."""
    return (
        params.is_greedy
        and params.logprobs is None
        and not params.needs_penalties
        and not params.logit_bias
        and num_output_tokens >= params.min_tokens
    )


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's token when every row `takes_argmax`: what the sampler would pick."""
    return argmax_rows(logits if logits.dtype == torch.float32 else logits.float()).tolist()


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Logit bias, min_tokens masking and penalties; copies only when there is work to do."""
    md = metadata
    if md.logit_bias is None and md.min_tokens_mask is None and md.penalties is None:
        return logits
    logits = logits.clone()
    if md.logit_bias is not None:
        rows, ids, values = md.logit_bias
        logits.index_put_((rows, ids), values, accumulate=True)
    if md.min_tokens_mask is not None:
        _ban_stop_tokens(logits, md.min_tokens_mask)
    if md.penalties is not None:
        apply_penalties(logits, md.penalties)
    return logits


def _ban_stop_tokens(logits: torch.Tensor, mask: tuple[torch.Tensor, torch.Tensor]) -> None:
    """min_tokens: stop tokens get -inf, except in a row where they are all that is left (a
    grammar that can only end, masked before): there the grammar wins, as in vLLM, and the
    request ends when its matcher accepts the stop token. No host sync."""
    kept = logits[mask]
    logits.index_put_(mask, torch.tensor(_NEG_INF, device=logits.device))
    rows, row_of_entry = torch.unique(mask[0], return_inverse=True)  # only the banned rows
    emptied = torch.isneginf(logits[rows]).all(dim=-1)[row_of_entry]
    logits.index_put_(mask, torch.where(emptied, kept, _NEG_INF))


def apply_penalties(logits: torch.Tensor, pen: PenaltyMetadata) -> torch.Tensor:
    """In place: repetition (HF: over prompt + output), then presence/frequency (OpenAI: output)."""
    sub = logits if pen.rows is None else logits[pen.rows]
    if pen.repetition is not None and pen.seen_mask is not None:
        scaled = torch.where(sub > 0, sub / pen.repetition, sub * pen.repetition)
        sub = torch.where(pen.seen_mask, scaled, sub)
    counts = pen.output_counts
    sub = sub - pen.frequency * counts - pen.presence * (counts > 0).float()
    if pen.rows is None:
        logits.copy_(sub)
    else:
        logits[pen.rows] = sub
    return logits


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
    """The sampled token's log-probability and rank, plus the top-k tokens, from one tensor."""
    token_logprobs = logprobs.gather(-1, sampled[:, None])
    ranks = (logprobs > token_logprobs).sum(dim=-1) + 1
    top_logprobs, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([sampled[:, None], top_ids], dim=1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=1),
        ranks=ranks,
    )


def mix_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed from (request seed, output position) only, so a seeded request
    draws the same noise whatever else is batched with it, and again after recomputation."""
    return _splitmix64(_splitmix64(seed & _MASK64) + position)


def _splitmix64(value: int) -> int:
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def random_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, softmax; never modifies `logits`."""
    assert md.temperature is not None
    logits = logits / md.temperature[:, None]  # new tensor: the masks below work in place
    logits = apply_top_k_top_p(logits, md.top_k, md.max_top_k, md.top_p)
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    return logits.softmax(dim=-1)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, max_top_k: int, top_p: torch.Tensor | None
) -> torch.Tensor:
    """In place: mask tokens outside top-k, then outside the top-p nucleus, with one sort."""
    if top_p is None:
        if top_k is None:
            return logits
        kth = logits.topk(max_top_k, dim=-1).values.gather(-1, (top_k - 1)[:, None])
        return logits.masked_fill_(logits < kth, _NEG_INF)
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        kth = sorted_logits.gather(-1, (logits.shape[-1] - top_k)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Drop a token when it and everything less likely fit in 1 - top_p: what is left is the
    # smallest set with mass >= top_p. The most likely token always stays.
    drop = cumulative <= (1.0 - top_p)[:, None]
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, _NEG_INF)
    return logits.scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """In place: drop tokens with prob < min_p * max prob, i.e. logit < max + log(min_p)."""
    threshold = logits.amax(dim=-1, keepdim=True) + torch.log(min_p)[:, None]
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def _temperature_fields(
    params: list[SamplingParams], device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, bool, bool]:
    greedy = [p.is_greedy for p in params]
    all_greedy, all_random = all(greedy), not any(greedy)
    if all_greedy:
        return None, None, True, False
    temps = [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)]
    temperature = torch.tensor(temps, dtype=torch.float32, device=device)
    mask = None if all_random else torch.tensor(greedy, dtype=torch.bool, device=device)
    return temperature, mask, False, all_random


def _top_k_field(
    params: list[SamplingParams],
    random_params: list[SamplingParams],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor | None, int]:
    if not any(0 < p.top_k < vocab_size for p in random_params):
        return None, 0
    ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    return torch.tensor(ks, dtype=torch.long, device=device), max(ks)


def _float_field(
    params: list[SamplingParams],
    random_params: list[SamplingParams],
    name: str,
    neutral: float,
    device: torch.device,
) -> torch.Tensor | None:
    """A [B] tensor of `name`, or None when every random row has the neutral value."""
    if all(getattr(p, name) == neutral for p in random_params):
        return None
    return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)


def _penalty_fields(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device,
) -> PenaltyMetadata | None:
    rows = [i for i, p in enumerate(params) if p.needs_penalties]
    if not rows:
        return None
    counts = _token_counts([output_token_ids[i] for i in rows], vocab_size, device)
    repetition = [params[i].repetition_penalty for i in rows]
    rep_tensor = seen = None
    if any(r != 1.0 for r in repetition):
        prompt_counts = _token_counts([prompt_token_ids[i] for i in rows], vocab_size, device)
        seen = (prompt_counts + counts) > 0
        rep_tensor = _column(repetition, device)
    return PenaltyMetadata(
        rows=None if len(rows) == len(params) else torch.tensor(rows, device=device),
        output_counts=counts,
        presence=_column([params[i].presence_penalty for i in rows], device),
        frequency=_column([params[i].frequency_penalty for i in rows], device),
        repetition=rep_tensor,
        seen_mask=seen,
    )


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]


def _token_counts(seqs: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[P, V] token occurrence counts with one flat scatter_add (no per-row padding)."""
    flat = torch.tensor(list(itertools.chain.from_iterable(seqs)), dtype=torch.long)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
        raise ValueError(f"token id outside the vocabulary of {vocab_size}")
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(len(seqs)), lengths)
    index = (row * vocab_size + flat).to(device)
    counts = torch.zeros(len(seqs) * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(0, index, torch.ones_like(index, dtype=torch.float32))
    return counts.view(len(seqs), vocab_size)


def _min_tokens_field(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, ids) of stop tokens banned because the row has not reached min_tokens yet."""
    rows: list[int] = []
    ids: list[int] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) >= p.min_tokens:
            continue
        for token in p.all_stop_token_ids.union(p.stop_token_ids or ()):
            if 0 <= token < vocab_size:
                rows.append(i)
                ids.append(token)
    if not rows:
        return None
    return _long(rows, device), _long(ids, device)


def _logit_bias_field(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(rows, ids, values); ids outside the vocabulary are skipped (validate at the edge).

    Gathered with list extends, not entry by entry: the online benchmark's requests each carry
    ~165 biases, ~5,000 entries a step at 32 requests."""
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += itertools.repeat(i, len(p.logit_bias))
            ids += map(int, p.logit_bias)
            values += map(float, p.logit_bias.values())
    if not rows:
        return None
    if min(ids) < 0 or max(ids) >= vocab_size:
        kept = [k for k, token in enumerate(ids) if 0 <= token < vocab_size]
        rows = [rows[k] for k in kept]
        ids = [ids[k] for k in kept]
        values = [values[k] for k in kept]
        if not rows:
            return None
    bias_values = torch.tensor(values, dtype=torch.float32, device=device)
    return _long(rows, device), _long(ids, device), bias_values


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
