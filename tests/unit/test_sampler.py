"""Sampler tests: exact checks against straightforward references, and chi-square tests on draws."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from tokenmill.layers.sampler import (
    Sampler,
    SamplingMetadata,
    greedy_tokens,
    process_logits,
    random_probs,
    takes_argmax,
)
from tokenmill.sampling_params import SamplingParams

CPU = torch.device("cpu")
# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
PROBS5 = [0.4, 0.3, 0.15, 0.1, 0.05]


def compute_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution the sampler draws each row from, built from its own steps (greedy rows
    one-hot): what the draws and the row-by-row references are checked against."""
    logits = process_logits(logits.float(), md)
    greedy = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    if md.all_greedy:
        return greedy
    probs = random_probs(logits, md)
    if md.greedy_mask is not None:
        probs = torch.where(md.greedy_mask[:, None], greedy, probs)
    return probs


def build(
    params: list[SamplingParams],
    vocab: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplingMetadata:
    prompts = prompts if prompts is not None else [[] for _ in params]
    outputs = outputs if outputs is not None else [[] for _ in params]
    return SamplingMetadata.build(params, prompts, outputs, CPU, vocab)


def sampler(seed: int = 0) -> Sampler:
    return Sampler(generator=torch.Generator().manual_seed(seed))


def chi2_stat(samples: torch.Tensor, probs: list[float]) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; raises if a zero-probability token appears."""
    p = np.asarray(probs, dtype=np.float64)
    counts = np.bincount(samples.numpy(), minlength=len(p))
    support = p > 0
    assert counts[~support].sum() == 0, f"excluded tokens drawn: {counts}"
    expected = p[support] / p[support].sum() * len(samples)
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def assert_distribution(samples: torch.Tensor, probs: list[float]) -> None:
    stat, df = chi2_stat(samples, probs)
    assert stat < CHI2_999[df], f"chi2 {stat:.1f} >= {CHI2_999[df]} (df={df})"


def draw(params: SamplingParams, logits_row: torch.Tensor, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws of one request, as n identical rows of one batch."""
    logits = logits_row.expand(n, -1).clone()
    out = sampler(seed)(logits, build([params] * n, logits.shape[1]))
    return out.sampled_token_ids


# --- metadata ---------------------------------------------------------------------------------


def test_metadata_common_path_has_no_optional_tensors() -> None:
    md = build([SamplingParams(), SamplingParams(top_k=50, temperature=0.5)], vocab=50)
    assert md.all_random and not md.all_greedy and md.greedy_mask is None
    assert md.top_k is None  # top_k >= vocab is no limit
    assert md.top_p is None and md.min_p is None and md.penalties is None
    assert md.min_tokens_mask is None and md.logit_bias is None
    assert md.max_num_logprobs is None and md.seeded_rows == []
    assert md.temperature is not None and md.temperature.tolist() == [1.0, 0.5]


def test_metadata_flags_greedy_and_positions() -> None:
    params = [SamplingParams(temperature=0.0, seed=3), SamplingParams(seed=4, logprobs=2)]
    params.append(SamplingParams(logprobs=5, top_p=0.5))
    md = build(params, vocab=10, outputs=[[1], [1, 2, 3], []])
    assert not md.all_greedy and not md.all_random
    assert md.greedy_mask is not None and md.greedy_mask.tolist() == [True, False, False]
    assert md.seeded_rows == [1]  # a greedy row's seed draws nothing
    assert md.output_positions == [1, 3, 0]
    assert md.max_num_logprobs == 5
    assert md.top_p is not None and md.top_k is None
    all_greedy = build([SamplingParams(temperature=0.0)], vocab=10)
    assert all_greedy.all_greedy and all_greedy.temperature is None


def test_metadata_rejects_token_ids_outside_vocab_for_penalties() -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        build([SamplingParams(frequency_penalty=1.0)], vocab=5, outputs=[[7]])


# --- greedy and temperature -------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 100)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6)] * 8
    out = sampler()(logits, build(params, 100))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    probs = compute_probs(logits, build(params, 100))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 100).float())


def test_temperature_frequencies_match_softmax() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2])
    samples = draw(SamplingParams(temperature=0.7), logits, 20_000)
    target = torch.softmax(logits.double() / 0.7, -1).tolist()
    assert_distribution(samples, target)
    # The test has power: the untempered distribution is rejected.
    stat, df = chi2_stat(samples, torch.softmax(logits.double(), -1).tolist())
    assert stat > CHI2_999[df]


def test_engine_generator_makes_unseeded_rows_reproducible() -> None:
    logits = torch.randn(64, 500, generator=torch.Generator().manual_seed(1))
    md = build([SamplingParams()] * 64, 500)
    first = sampler(7)(logits, md).sampled_token_ids
    assert torch.equal(first, sampler(7)(logits, md).sampled_token_ids)
    assert not torch.equal(first, sampler(8)(logits, md).sampled_token_ids)


def test_mixed_greedy_and_random_batch() -> None:
    logits_row = torch.tensor([0.3, 1.2, -0.4, 0.9, 0.0, -1.0, 0.6, 0.1])
    n = 10_000
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3)] * n
    logits = logits_row.expand(2 * n, -1).clone()
    md = build(params, 8)
    tokens = sampler(3)(logits, md).sampled_token_ids
    assert (tokens[0::2] == 1).all()
    target = torch.softmax(logits_row.double() / 1.3, -1)
    assert_distribution(tokens[1::2], target.tolist())
    probs = compute_probs(logits[:2], build(params[:2], 8))
    assert probs[0].tolist() == [0.0, 1.0] + [0.0] * 6
    torch.testing.assert_close(probs[1].double(), target, atol=1e-6, rtol=0)


# --- truncation -------------------------------------------------------------------------------


def test_top_k_keeps_renormalised_top_tokens() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.3, 1.0, -0.5, 0.0])
    samples = draw(SamplingParams(top_k=3), logits, 20_000)
    target = torch.softmax(logits.double(), -1)
    target[[0, 2, 4, 6, 7]] = 0.0
    assert_distribution(samples, target.tolist())


def test_top_p_keeps_smallest_nucleus() -> None:
    logits = torch.tensor(PROBS5).log()
    samples = draw(SamplingParams(top_p=0.8), logits, 20_000)
    assert_distribution(samples, [0.4, 0.3, 0.15, 0.0, 0.0])  # 0.7 < 0.8 <= 0.85


def test_top_p_applies_after_top_k_renormalisation() -> None:
    # After top-k=2 the renormalised probs are [0.571, 0.429]: top_p=0.5 keeps token 0 only.
    # Without renormalisation 0.4 < 0.5 would keep token 1 too. The other row keeps 4 tokens.
    logits = torch.tensor(PROBS5).log().expand(2, -1).clone()
    params = [SamplingParams(top_k=2, top_p=0.5), SamplingParams(top_p=0.9)]
    probs = compute_probs(logits, build(params, 5)).double()
    torch.testing.assert_close(probs[0], torch.tensor([1.0, 0, 0, 0, 0], dtype=torch.double))
    expected = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.0], dtype=torch.double) / 0.95
    torch.testing.assert_close(probs[1], expected, atol=1e-6, rtol=0)


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.tensor(PROBS5).log()
    samples = draw(SamplingParams(min_p=0.3), logits, 20_000)  # threshold 0.12
    assert_distribution(samples, [0.4, 0.3, 0.15, 0.0, 0.0])


# --- seeds ------------------------------------------------------------------------------------


def seeded_sequence(seed: int, logits_row: torch.Tensor, crowd: bool) -> list[int]:
    """Tokens of one seeded request over 12 positions, alone or amid a busy batch."""
    tokens = []
    vocab = logits_row.shape[0]
    gen = torch.Generator().manual_seed(seed + 99)
    for pos in range(12):
        me = SamplingParams(seed=seed)
        if not crowd:
            md = build([me], vocab, outputs=[[0] * pos])
            tokens.append(int(sampler(pos)(logits_row[None], md).sampled_token_ids[0]))
            continue
        others = [
            SamplingParams(),
            SamplingParams(seed=seed + 1, top_k=5),
            SamplingParams(temperature=0.0),
            SamplingParams(top_p=0.5, min_p=0.1, frequency_penalty=0.5),
        ]
        rows = [*others[: pos % 4], me, *others[pos % 4 :]]
        logits = torch.randn(len(rows), vocab, generator=gen)
        mine = rows.index(me)
        logits[mine] = logits_row
        outputs = [[1, 2] * (i + 1) for i in range(len(rows))]
        outputs[mine] = [0] * pos
        md = build(rows, vocab, outputs=outputs)
        out = sampler(1000 + pos)(logits, md)
        tokens.append(int(out.sampled_token_ids[mine]))
    return tokens


def test_seeded_rows_ignore_batch_composition() -> None:
    logits_row = torch.randn(1000, generator=torch.Generator().manual_seed(5)) * 0.1
    alone = seeded_sequence(1234, logits_row, crowd=False)
    assert seeded_sequence(1234, logits_row, crowd=True) == alone
    assert len(set(alone)) > 6  # the noise changes with the output position
    assert seeded_sequence(4321, logits_row, crowd=False) != alone
    assert seeded_sequence(-5, logits_row, crowd=False) != alone  # negative seeds are allowed


def test_seeded_draws_follow_the_distribution() -> None:
    logits_row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 1.5, -1.0, 0.2])
    n = 4000
    params = [SamplingParams(seed=s, temperature=0.9) for s in range(n)]
    md = build(params, 8)
    tokens = sampler()(logits_row.expand(n, -1).clone(), md).sampled_token_ids
    assert_distribution(tokens, torch.softmax(logits_row.double() / 0.9, -1).tolist())


# --- penalties, min_tokens, logit_bias --------------------------------------------------------


def reference_processed(
    logits_row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """Row-at-a-time bias, min_tokens, repetition (HF), presence and frequency (OpenAI)."""
    x = logits_row.double().clone()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    if len(output) < p.min_tokens:
        for token in p.all_stop_token_ids | set(p.stop_token_ids or []):
            x[token] = -math.inf
    if p.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            r = p.repetition_penalty
            x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token in set(output):
        x[token] -= p.presence_penalty + p.frequency_penalty * output.count(token)
    return x


def reference_probs(
    logits_row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """Row-at-a-time target distribution, written for clarity rather than speed."""
    x = reference_processed(logits_row, p, prompt, output)
    vocab = x.shape[0]
    if p.is_greedy:
        return torch.nn.functional.one_hot(x.argmax(), vocab).double()
    x = x / p.temperature
    if 0 < p.top_k < vocab:
        kth = x.sort(descending=True).values[p.top_k - 1]
        x[x < kth] = -math.inf
    if p.top_p < 1.0:
        probs, mass, keep = x.softmax(-1), 0.0, []
        for token in x.argsort(descending=True).tolist():
            keep.append(token)
            mass += float(probs[token])
            if mass >= p.top_p:
                break
        dropped = torch.ones(vocab, dtype=torch.bool)
        dropped[keep] = False
        x[dropped] = -math.inf
    if p.min_p > 0.0:
        probs = x.softmax(-1)
        x[probs < p.min_p * probs.max()] = -math.inf
    return x.softmax(-1)


def random_params(rng: random.Random, vocab: int, top_p: bool) -> SamplingParams:
    pick = rng.choice
    return SamplingParams(
        temperature=pick([0.0, 0.5, 1.0, 1.7]),
        top_k=pick([0, 0, 3, 10]),
        top_p=pick([1.0, 1.0, 0.6, 0.9]) if top_p else 1.0,
        min_p=pick([0.0, 0.0, 0.05, 0.2]),
        presence_penalty=pick([0.0, 0.0, 0.7, -1.1]),
        frequency_penalty=pick([0.0, 0.0, 0.4, -0.3]),
        repetition_penalty=pick([1.0, 1.0, 1.3, 0.8]),
        logit_bias=pick([None, {rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(3)}]),
        min_tokens=pick([0, 0, 4]),
        stop_token_ids=pick([[], [rng.randrange(vocab)]]),
        all_stop_token_ids={vocab - 1},
    )


def random_batch(
    seed: int, rows: int, vocab: int, top_p: bool = True
) -> tuple[torch.Tensor, list[SamplingParams], list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    params = [random_params(rng, vocab, top_p) for _ in range(rows)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(12))] for _ in range(rows)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(8))] for _ in range(rows)]
    return logits, params, prompts, outputs


@pytest.mark.parametrize(("seed", "top_p"), [(0, True), (1, True), (2, False), (3, False)])
def test_compute_probs_matches_row_by_row_reference(seed: int, top_p: bool) -> None:
    """Mixed per-row parameters; without top-p the top-k-only fast path runs instead of a sort."""
    logits, params, prompts, outputs = random_batch(seed, rows=32, vocab=40, top_p=top_p)
    md = SamplingMetadata.build(params, prompts, outputs, CPU, 40)
    probs = compute_probs(logits, md).double()
    for i, p in enumerate(params):
        expected = reference_probs(logits[i], p, prompts[i], outputs[i])
        torch.testing.assert_close(probs[i], expected, atol=1e-5, rtol=0, msg=f"row {i}: {p}")


def test_penalties_match_reference_for_subset_and_all_rows() -> None:
    rng = random.Random(7)
    vocab = 30
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(7))
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=-0.5),
        SamplingParams(temperature=0.0, presence_penalty=-1.0),
        SamplingParams(),
        SamplingParams(repetition_penalty=0.7),
    ]
    prompts = [[rng.randrange(vocab) for _ in range(10)] for _ in params]
    outputs = [[rng.randrange(vocab) for _ in range(15)] for _ in params]
    for subset in (range(6), [0, 2, 3, 5]):  # with unpenalised rows, and with none
        sub = list(subset)
        md = SamplingMetadata.build(
            [params[i] for i in sub], [prompts[i] for i in sub], [outputs[i] for i in sub], CPU, 30
        )
        got = process_logits(logits[sub], md)
        for row, i in enumerate(sub):
            expected = reference_processed(logits[i], params[i], prompts[i], outputs[i])
            torch.testing.assert_close(got[row].double(), expected, atol=1e-5, rtol=0)


def test_repetition_penalty_matches_transformers() -> None:
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    rng = random.Random(3)
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)) * 3
    penalties = [1.2, 0.8, 2.0, 1.0]
    params = [SamplingParams(repetition_penalty=r) for r in penalties]
    prompts = [[rng.randrange(vocab) for _ in range(20)] for _ in params]
    outputs = [[rng.randrange(vocab) for _ in range(10)] for _ in params]
    got = process_logits(logits, SamplingMetadata.build(params, prompts, outputs, CPU, vocab))
    for i, r in enumerate(penalties):
        processor = logits_process.RepetitionPenaltyLogitsProcessor(penalty=r)
        ids = torch.tensor([prompts[i] + outputs[i]])
        expected = processor(ids, logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], expected, atol=1e-6, rtol=0)


def test_min_tokens_blocks_stop_tokens_until_reached() -> None:
    vocab = 10
    logits_row = torch.arange(vocab, dtype=torch.float32)  # 9 (eos) > 8 (stop id) > 7
    stop = {"min_tokens": 3, "stop_token_ids": [8], "all_stop_token_ids": {9}}
    params = [
        SamplingParams(temperature=0.0, **stop),
        SamplingParams(temperature=0.0, **stop),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=3.0, **stop),
    ]
    outputs = [[1, 2], [1, 2, 3], [], []]
    logits = logits_row.expand(4, -1).clone()
    tokens = sampler()(logits, build(params, vocab, outputs=outputs)).sampled_token_ids
    assert tokens[:3].tolist() == [7, 9, 9]
    n = 3000
    samples = draw(SamplingParams(temperature=3.0, **stop), logits_row, n)
    assert not ((samples == 8) | (samples == 9)).any()
    assert len(samples.unique()) == 8  # the rest stay reachable


def test_min_tokens_leaves_stop_tokens_where_nothing_else_is_allowed() -> None:
    """A row a grammar has already masked to its stop tokens keeps them (rather than sampling
    from nothing); a row with other tokens left still has its stop tokens banned."""
    vocab = 10
    stop = {"min_tokens": 3, "stop_token_ids": [8], "all_stop_token_ids": {9}}
    logits = torch.arange(vocab, dtype=torch.float32).expand(2, -1).clone()
    logits[0, :8] = float("-inf")  # only the stop tokens 8 and 9 left
    logits[1, :7] = float("-inf")  # 7 left beside them
    params = [SamplingParams(temperature=0.0, **stop)] * 2
    processed = process_logits(logits, build(params, vocab))
    torch.testing.assert_close(processed[0], logits[0])
    assert processed[1].isneginf().tolist() == [True] * 7 + [False, True, True]
    tokens = sampler()(logits, build(params, vocab)).sampled_token_ids
    assert tokens.tolist() == [9, 7]


def test_logit_bias_shifts_only_its_row() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 20)
    params = [
        SamplingParams(temperature=0.0, logit_bias={int(logits[0].argmin()): 100.0, 99: 5.0}),
        SamplingParams(temperature=0.0),
        SamplingParams(logit_bias={4: -2.5, 6: 1.0}),
    ]
    md = build(params, 20)
    out = sampler()(logits, md)
    assert int(out.sampled_token_ids[0]) == int(logits[0].argmin())  # out-of-vocab 99 ignored
    assert int(out.sampled_token_ids[1]) == int(logits[1].argmax())
    expected = logits.clone()
    expected[0, logits[0].argmin()] += 100.0
    expected[2, 4] -= 2.5
    expected[2, 6] += 1.0
    torch.testing.assert_close(process_logits(logits, md), expected)
    assert build([SamplingParams(logit_bias={99: 1.0, 20: 2.0})], 20).logit_bias is None


def test_forward_does_not_modify_input_logits() -> None:
    logits, params, prompts, outputs = random_batch(11, rows=16, vocab=40)
    before = logits.clone()
    sampler()(logits, SamplingMetadata.build(params, prompts, outputs, CPU, 40))
    assert torch.equal(logits, before)


# --- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_raw_with_ranks_and_top_n() -> None:
    torch.manual_seed(4)
    vocab = 50
    logits = torch.randn(5, vocab) * 2
    lowest = int(logits[0].argmin())
    params = [
        SamplingParams(temperature=0.0, logit_bias={lowest: 100.0}, logprobs=3),
        SamplingParams(temperature=0.5, top_k=5, presence_penalty=1.0),
        SamplingParams(logprobs=0, repetition_penalty=1.4),
        SamplingParams(logprobs=5, min_p=0.1),
        SamplingParams(temperature=0.0, logprobs=2),
    ]
    md = build(params, vocab, prompts=[[1, 2, 3]] * 5, outputs=[[4, 5]] * 5)
    out = sampler()(logits, md)
    lp = out.logprobs
    assert lp is not None and md.max_num_logprobs == 5
    assert lp.token_ids.shape == (5, 6) and lp.logprobs.shape == (5, 6)
    raw = torch.log_softmax(logits, -1)
    sampled = out.sampled_token_ids
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top = raw.topk(5, -1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    order = raw.argsort(dim=-1, descending=True)
    ranks = [order[i].tolist().index(int(sampled[i])) + 1 for i in range(5)]
    assert lp.ranks.tolist() == ranks
    assert ranks[0] == vocab and ranks[4] == 1  # biased pick keeps its raw rank


def test_no_logprobs_requested_returns_none() -> None:
    out = sampler()(torch.randn(2, 10), build([SamplingParams()] * 2, 10))
    assert out.logprobs is None
    assert out.sampled_token_ids.dtype == torch.long and out.sampled_token_ids.shape == (2,)


def test_rows_that_take_the_argmax_get_the_full_samplers_token() -> None:
    """`takes_argmax` rows skip the sampler (`greedy_tokens`): the very token it would pick;
    every feature that could change that token keeps a row on the full path."""
    vocab, rows = 50, 6
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = logits[1, 3] = logits[1].max() + 1  # a tie: the first index wins
    stops = {"stop_token_ids": [int(logits[0].argmax())], "min_tokens": 2}
    cases = [
        (SamplingParams(temperature=0.0), 0, True),
        (SamplingParams(temperature=0.0, **stops), 2, True),  # min_tokens reached
        (SamplingParams(temperature=0.0, **stops), 1, False),  # its stop token banned
        (SamplingParams(temperature=0.0, frequency_penalty=1.0), 0, False),
        (SamplingParams(temperature=0.0, logit_bias={5: 100.0}), 0, False),
        (SamplingParams(temperature=0.0, logprobs=2), 0, False),
        (SamplingParams(temperature=0.8), 0, False),
    ]
    for params, num_output, expected in cases:
        assert takes_argmax(params, num_output) == expected, params
        if expected:
            outputs = [list(range(num_output))] * rows
            full = sampler()(logits, build([params] * rows, vocab, outputs=outputs))
            assert greedy_tokens(logits) == full.sampled_token_ids.tolist()
    assert greedy_tokens(logits.bfloat16()) == logits.bfloat16().float().argmax(-1).tolist()
