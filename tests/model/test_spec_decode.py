"""Speculative decoding end to end: greedy outputs identical with and without it (n-gram,
suffix decoding and draft model) through chunked prefill, prefix hits and preemption; sampled
outputs distributed as the target's (chi-square on a small-vocabulary model); seeded outputs
reproducible."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def target(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def other_draft(tiny_checkpoint) -> str:
    """A different random model: its drafts are mostly rejected, exercising rollback."""
    return str(tiny_checkpoint("llama", seed=7, num_hidden_layers=1))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    phrase = [rng.randrange(10, 1000) for _ in range(9)]
    return [
        phrase * 4,  # repetitive: n-gram drafts get accepted
        [rng.randrange(10, 1000) for _ in range(30)],
        [*phrase * 2, 11, 12, 13],
        phrase[:5],
    ]


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """In two waves, so the second can hit the prefix cache."""
    first = llm.generate(prompts[:2], params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in first + second]


def make(checkpoint: str, spec: dict | None, **kwargs) -> LLM:
    return LLM(
        model=checkpoint, dtype="float32", speculative_config=spec, max_model_len=128, **kwargs
    )


@pytest.fixture(scope="module")
def reference(target, prompts) -> list[list[int]]:
    return generate(make(target, None), prompts, greedy())


def spec_configs(target: str, other_draft: str) -> dict[str, dict]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
        # Eager drafts (long from short matches, however unlikely): KV pressure, rollbacks;
        # only the request's own trie (the shared cache: test_suffix_cache_drafts_are_lossless).
        "suffix": {
            "method": "suffix",
            "num_speculative_tokens": 4,
            "adaptive": False,
            "suffix_decoding_max_spec_factor": 4.0,
            "suffix_decoding_min_token_prob": 0.0,
            "suffix_decoding_max_cached_requests": 0,
        },
        "self-draft": {"method": "draft_model", "model": target, "num_speculative_tokens": 3},
        "other-draft": {
            "method": "draft_model",
            "model": other_draft,
            "num_speculative_tokens": 3,
            "adaptive": False,
        },
    }


ENGINE_VARIANTS = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 12, "block_size": 4},
    "preempting": {"num_kv_blocks": 32, "block_size": 4},
    # Drafts count towards the step cost; a target no step meets: prompts move by the floor.
    "itl-target": {"itl_target_ms": 0.001, "block_size": 4},
}


@pytest.mark.parametrize("method", ["ngram", "suffix", "self-draft", "other-draft"])
@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
def test_greedy_output_is_identical_with_speculation(
    target, other_draft, prompts, reference, method, variant
) -> None:
    llm = make(target, spec_configs(target, other_draft)[method], **ENGINE_VARIANTS[variant])
    assert generate(llm, prompts, greedy()) == reference
    stats = llm.get_stats().scheduler
    assert stats.spec_decode is not None and stats.spec_decode.num_draft_tokens > 0
    assert stats.prefix_cache.hits > 0
    if method == "self-draft":  # the draft is the target: every draft is right
        assert stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens
    if variant == "preempting":
        assert stats.num_preemptions > 0
    manager = llm.engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks, "rollback leaked blocks"


def test_suffix_cache_drafts_are_lossless(target, prompts, reference) -> None:
    """The second wave repeats the first's prompts: suffix decoding drafts their outputs from
    its cache of finished requests (vLLM's defaults otherwise), all accepted."""
    llm = make(target, {"method": "suffix", "adaptive": False}, block_size=4)
    assert generate(llm, prompts, greedy()) == reference
    stats = llm.get_stats().scheduler.spec_decode
    assert stats is not None and stats.num_accepted_tokens >= 2 * (MAX_TOKENS // 2)


def test_seeded_sampling_is_the_same_with_and_without_speculation(target, prompts) -> None:
    params = SamplingParams(
        temperature=0.9, top_p=0.95, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True
    )
    plain = generate(make(target, None), prompts, params)
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    assert generate(make(target, spec), prompts, params) == plain


def test_logprobs_are_the_targets_under_speculation(target, prompts) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    plain = make(target, None).generate(prompts, params, use_tqdm=False)
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    fast = make(target, spec).generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, fast):
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert pa.keys() == pb.keys()
            assert all(abs(pa[t].logprob - pb[t].logprob) < 1e-4 for t in pa)


# ---- the distribution: a small-vocabulary model, exact target probabilities, chi-square ----

VOCAB = 8
PROMPT = [*range(VOCAB), *range(VOCAB)]  # every token has occurred: n-gram drafts always


def target_joint(model_dir: str, temperature: float, top_p: float) -> dict[tuple[int, int], float]:
    """P(t1, t2 | PROMPT) under the target, after temperature and top-p, from transformers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def next_probs(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([tokens])).logits[0, -1].double() / temperature
        probs = torch.softmax(logits, -1)
        ordered, order = probs.sort(descending=True)
        keep = (ordered.cumsum(0) - ordered) < top_p  # smallest set reaching top_p
        kept = torch.zeros_like(probs)
        kept[order[keep]] = ordered[keep]
        return kept / kept.sum()

    first = next_probs(PROMPT)
    joint = {}
    for t1 in range(VOCAB):
        if first[t1] > 0:
            second = next_probs([*PROMPT, t1])
            for t2 in range(VOCAB):
                joint[(t1, t2)] = float(first[t1] * second[t2])
    return joint


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty), so no scipy is needed."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(counts: Counter, joint: dict[tuple[int, int], float], n: int) -> tuple[float, int]:
    """Pearson's statistic; cells expected fewer than 5 times are pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in joint.items():
        expected = p * n
        if expected < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += expected
            continue
        stat += (counts.get(cell, 0) - expected) ** 2 / expected
        cells += 1
    unexpected = sum(c for cell, c in counts.items() if joint.get(cell, 0.0) == 0.0)
    assert unexpected == 0, "sampled a token pair the target gives zero probability"
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    return stat, cells - 1


@pytest.fixture(scope="module")
def small_vocab_model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama", vocab_size=VOCAB, seed=5))


@pytest.mark.parametrize(
    ("method", "temperature", "top_p"),
    [
        ("draft_model", 1.5, 1.0),
        ("ngram", 2.0, 0.9),
        ("suffix", 2.0, 0.9),
        ("draft_model", 3.0, 0.8),
    ],
)
@pytest.mark.slow(reason="a statistical test: thousands of samples")
def test_sampled_tokens_follow_the_target_distribution(
    small_vocab_model, method, temperature, top_p
) -> None:
    n = 3000
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "draft_model":
        spec["model"] = small_vocab_model
    llm = make(small_vocab_model, spec, max_num_seqs=256, max_num_batched_tokens=4096)
    # Token 2 comes from verifying a draft (max_tokens 3 leaves room for one draft).
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([PROMPT] * n, params, use_tqdm=False)
    counts = Counter(tuple(o.outputs[0].token_ids[:2]) for o in outputs)
    stats = llm.get_stats().scheduler.spec_decode
    assert stats.num_draft_tokens > n / 2, "the second token should mostly come from verification"
    joint = target_joint(small_vocab_model, temperature, top_p)
    statistic, dof = chi_square(counts, joint, n)
    assert dof >= 4, "the distribution is too peaked for the test to mean much"
    print(f"{method} T={temperature} top_p={top_p}: chi2={statistic:.1f}, dof={dof}")
    assert statistic < chi_square_critical(dof)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_n_samples_with_speculation_match_without(target, prompts, method) -> None:
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    plain = make(target, None).generate(prompts[:2], params, use_tqdm=False)
    fast = make(target, spec).generate(prompts[:2], params, use_tqdm=False)
    for a, b in zip(plain, fast):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


class _SkippingPolicy:
    """Drafts 3 tokens on one step in three, none on the others: the draft model must catch
    up on the tokens verified while it was idle before proposing again."""

    def __init__(self) -> None:
        self.calls = 0

    def choose(self, num_decodes: int) -> int:
        self.calls += 1
        return 3 if self.calls % 3 == 0 else 0

    def observe(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("variant", sorted(ENGINE_VARIANTS))
def test_draft_model_catches_up_after_steps_without_drafts(
    target, prompts, reference, variant
) -> None:
    """The target drafting for itself: every proposal must be accepted, so a draft KV cache
    left stale by skipped steps (or by preemption) would show up as a rejection."""
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    llm = make(target, spec, **ENGINE_VARIANTS[variant])
    llm.engine.scheduler.spec_policy = _SkippingPolicy()
    assert generate(llm, prompts, greedy()) == reference
    stats = llm.get_stats().scheduler
    assert stats.spec_decode is not None and stats.spec_decode.num_draft_tokens > 0
    assert stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens
    if variant == "preempting":
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("forward_tokens, extra_tokens", [(7, 256), (2048, 3)])
def test_draft_catch_up_split_over_forwards_and_steps(
    target, prompts, reference, monkeypatch, forward_tokens, extra_tokens
):
    """Catch-up forwards of 7 tokens split prompts mid-request; a 3-token budget beyond the
    steady state's spreads a request's catch-up over several steps before it drafts."""
    module = "tokenmill.spec_decode.draft_model"
    monkeypatch.setattr(f"{module}.CATCH_UP_TOKENS_PER_FORWARD", forward_tokens)
    monkeypatch.setattr(f"{module}.CATCH_UP_EXTRA_TOKENS", extra_tokens)
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    llm = make(target, spec)
    llm.engine.scheduler.spec_policy = _SkippingPolicy()
    assert generate(llm, prompts, greedy()) == reference
    stats = llm.get_stats().scheduler.spec_decode
    assert stats is not None and stats.num_accepted_tokens == stats.num_draft_tokens > 0


def draft_model_run(
    target: str, prompts: list[list[int]], dtype: str
) -> tuple[list[list[int]], tuple[int, int]]:
    """Greedy outputs of the target drafting for itself at a fixed k = 4, and the draft and
    accepted token counts."""
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 4}
    llm = LLM(
        model=target, dtype=dtype, speculative_config={**spec, "adaptive": False}, max_model_len=128
    )
    outputs = generate(llm, prompts, greedy())
    stats = llm.get_stats().scheduler.spec_decode
    assert stats is not None and stats.num_draft_tokens > 0
    return outputs, (stats.num_draft_tokens, stats.num_accepted_tokens)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_draft_chain_drafts_as_the_python_chain(target, prompts, monkeypatch, dtype):
    """The draft chain in one native call (`draft_chain`: embedding, stack, LM head, argmax,
    k - 1 times) proposes what the step-by-step chain proposes: the same outputs and the same
    draft counts, and it is the path taken where it applies."""
    from tokenmill.spec_decode import draft_model

    calls = []
    build = draft_model.DraftModelProposer._build_native_chain

    def counted(self):
        built = build(self)
        if built is None:
            return None
        module, embedding, head = built

        class Spy:
            def draft_chain(self, *args):
                calls.append(args[-1])
                return module.draft_chain(*args)

        return Spy(), embedding, head

    monkeypatch.setattr(draft_model.DraftModelProposer, "_build_native_chain", counted)
    native_run = draft_model_run(target, prompts, dtype)
    if not calls:
        pytest.skip("the native chain does not apply here (no native kernels)")
    assert set(calls) == {3}
    monkeypatch.setattr(draft_model.DraftModelProposer, "_build_native_chain", lambda self: None)
    assert draft_model_run(target, prompts, dtype) == native_run


def test_accepted_chain_drafts_need_no_draft_catch_up(target, prompts, reference, monkeypatch):
    """The chain's KV of accepted drafts counts as computed: the target drafting for itself
    (every draft accepted) catches up over 1-2 tokens a step instead of k + 1, with the same
    outputs, and every draft still accepted (stale KV would show up as a rejection)."""
    from tokenmill.spec_decode import draft_model

    def run() -> tuple[int, int]:
        rows: list[int] = []
        forward = draft_model.DraftModelProposer._forward

        def counted(self, states, input_ids, query_lens, seq_lens):
            # Catch-ups after a verification: pieces that do not start a request's prompt.
            rows.extend(q for q, e in zip(query_lens.tolist(), seq_lens.tolist()) if e > q)
            return forward(self, states, input_ids, query_lens, seq_lens)

        whole = draft_model.DraftModelProposer._whole_proposal

        def counted_whole(self, states, num_tokens):
            gaps = [len(s.token_ids) - s.num_draft_computed_tokens for s in states]
            started = [s.num_draft_computed_tokens > 0 for s in states]
            proposals = whole(self, states, num_tokens)
            if proposals is not None:  # the catch-up ran inside the one native call
                rows.extend(g for g, s in zip(gaps, started) if s)
            return proposals

        monkeypatch.setattr(draft_model.DraftModelProposer, "_forward", counted)
        monkeypatch.setattr(draft_model.DraftModelProposer, "_whole_proposal", counted_whole)
        spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 4}
        llm = make(target, {**spec, "adaptive": False})
        assert generate(llm, prompts, greedy()) == reference
        stats = llm.get_stats().scheduler.spec_decode
        assert stats is not None and stats.num_accepted_tokens == stats.num_draft_tokens > 0
        return sum(rows), len(rows)

    credited_rows, credited_steps = run()
    monkeypatch.setattr(draft_model, "credit_fed_tokens", lambda state: None)
    plain_rows, plain_steps = run()
    assert credited_steps == plain_steps > 0
    assert credited_rows <= 2 * credited_steps < plain_rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_proposal_in_one_call_drafts_as_two_calls(target, prompts, monkeypatch, dtype):
    """The catch-up folded into the native chain's call (`draft_proposal`) proposes what the
    catch-up forward from Python followed by the native chain proposes: the same outputs and
    draft counts, and the one call is the path taken in the steady state."""
    from tokenmill.spec_decode import draft_model

    calls = []
    whole = draft_model.DraftModelProposer._whole_proposal

    def counted(self, states, num_tokens):
        proposals = whole(self, states, num_tokens)
        calls.append(proposals is not None)
        return proposals

    monkeypatch.setattr(draft_model.DraftModelProposer, "_whole_proposal", counted)
    one_call = draft_model_run(target, prompts, dtype)
    if not any(calls):
        pytest.skip("the native proposal does not apply here (no native kernels)")
    assert sum(calls) > len(calls) // 2  # most proposals, steady state
    monkeypatch.setattr(
        draft_model.DraftModelProposer, "_whole_proposal", lambda self, states, k: None
    )
    assert draft_model_run(target, prompts, dtype) == one_call
