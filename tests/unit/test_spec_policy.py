"""The adaptive speculation policy gets close to the best fixed k, whichever that is."""

from __future__ import annotations

import random

from tokenmill.core.feedback.speculation_policy import SpeculationPolicy
from tokenmill.core.kv.cache_manager import KVCacheManager
from tokenmill.core.sched.output_applier import OutputApplier
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams
from tokenmill.step.request import Request
from tokenmill.step.runner_output import ModelRunnerOutput


def simulated_step(num_decodes: int, k: int, rng: random.Random) -> tuple[int, float]:
    """A machine where a step costs 10 ms + 0.5 ms per token, drafts are accepted with
    probability 0.7 each, and timings carry +-20 % noise."""
    tokens = 0
    for _ in range(num_decodes):
        accepted = 0
        while accepted < k and rng.random() < 0.7:
            accepted += 1
        tokens += accepted + 1
    seconds = (0.010 + 0.0005 * num_decodes * (k + 1)) * rng.uniform(0.8, 1.2)
    return tokens, seconds


def throughput(policy: SpeculationPolicy, num_decodes: int, steps: int = 400) -> float:
    rng = random.Random(num_decodes)
    total_tokens, total_seconds = 0, 0.0
    for _ in range(steps):
        k = policy.choose(num_decodes)
        tokens, seconds = simulated_step(num_decodes, k, rng)
        policy.observe(num_decodes, k, tokens, seconds)
        total_tokens += tokens
        total_seconds += seconds
    return total_tokens / total_seconds


def test_adaptive_is_never_meaningfully_slower_than_off_and_near_the_best_k() -> None:
    for num_decodes in (1, 8, 64):
        fixed = {k: throughput(SpeculationPolicy(k, adaptive=False), num_decodes) for k in (0, 4)}
        adaptive = throughput(SpeculationPolicy(4), num_decodes)
        # Exploring costs a little: at most 5 % below speculation off, 10 % below the best k.
        assert adaptive >= 0.95 * fixed[0], (num_decodes, fixed, adaptive)
        assert adaptive >= 0.90 * max(fixed.values()), (num_decodes, fixed, adaptive)


def test_it_speculates_at_batch_one_and_not_at_batch_64() -> None:
    policy = SpeculationPolicy(4)
    throughput(policy, 1)
    throughput(policy, 64)
    assert policy.choose(1) >= 3
    assert policy.choose(64) == 0


def _next_tokens(history: list[int], count: int) -> list[int]:
    """The fake model's greedy continuation of `history` (see test_scheduler.fake_next_token)."""
    tokens = list(history)
    for _ in range(count):
        tokens.append((sum(tokens) * 31 + len(tokens)) % 97)
    return tokens[len(history) :]


def _simulate(propose_ms_per_draft: float, steps: int = 600) -> tuple[float, int]:
    """One long request decoding through the real Scheduler with the adaptive policy, on a
    simulated machine: verifying costs 1 ms + 0.05 ms per token, proposing costs
    `propose_ms_per_draft` per draft, and 90 % of drafts match the model. Returns tokens per
    simulated second and the k the policy settles on."""
    rng = random.Random(0)
    scheduler = Scheduler(
        KVCacheManager(512, 16),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=4096,
        spec_policy=SpeculationPolicy(4),
    )
    params = SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0.0)
    scheduler.add_request(Request("r", list(range(1, 9)), params, max_tokens=3000))
    total_tokens, total_seconds = 0, 0.0
    for _ in range(steps):
        out = scheduler.schedule()
        request = scheduler.requests["r"]
        drafts = out.scheduled_spec_tokens.get("r", [])
        output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        seconds = 0.001 + 0.00005 * out.total_num_scheduled_tokens
        if request.num_computed_tokens + out.num_scheduled_tokens["r"] - len(drafts) == (
            request.num_tokens
        ):
            truth = _next_tokens(request.all_token_ids, len(drafts) + 1)
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == truth[accepted]:
                accepted += 1
            generated = truth[: accepted + 1]
            output = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[generated])
            k = out.num_spec_tokens_to_propose
            if k:
                future = _next_tokens(request.all_token_ids + generated, k)
                output.spec_token_ids = {"r": [t if rng.random() < 0.9 else 96 - t for t in future]}
                output.propose_seconds = propose_ms_per_draft * k / 1000
                seconds += output.propose_seconds
        OutputApplier(scheduler).update_from_output(out, output)
        num_generated = sum(len(t) for t in output.sampled_token_ids)
        scheduler.observer.ran(seconds, output)
        total_tokens += num_generated
        total_seconds += seconds
    assert scheduler.spec_policy is not None
    return total_tokens / total_seconds, scheduler.spec_policy.choose(1)


def test_policy_charges_drafts_to_the_step_that_verifies_them() -> None:
    """Proposing is paid in the step before the drafts are verified. With drafts that cost
    about a target step each, no k pays: the policy must settle on 0 and run at the speed of
    no speculation (1.05 ms per token). With cheap drafts it must keep drafting."""
    off_rate = 1 / 0.00105
    slow_rate, slow_k = _simulate(propose_ms_per_draft=1.0)
    assert slow_k == 0
    assert slow_rate >= 0.93 * off_rate, slow_rate / off_rate
    fast_rate, fast_k = _simulate(propose_ms_per_draft=0.02)
    assert fast_k >= 3
    assert fast_rate >= 2.0 * off_rate, fast_rate / off_rate


def _throughput_with_prefill(policy: SpeculationPolicy, num_decodes: int) -> float:
    """Decode tokens per second of decode time, with steps that also prefill: up to 2000
    prompt tokens at 0.02 ms each (up to 40 ms, more than the decodes cost) and,
    adversarially, more of them in k = 0 steps."""
    rng = random.Random(num_decodes)
    total_tokens, total_seconds = 0, 0.0
    for _ in range(800):
        k = policy.choose(num_decodes)
        tokens, seconds = simulated_step(num_decodes, k, rng)
        prefill = rng.randrange(1000) + (1000 if k == 0 else 0)
        policy.observe(num_decodes, k, tokens, seconds + 0.00002 * prefill, prefill)
        total_tokens += tokens
        total_seconds += seconds
    return total_tokens / total_seconds


def test_prefill_chunks_in_the_same_steps_do_not_hide_the_decode_cost() -> None:
    """The fit separates prefill from decode cost; a plain tokens/s average of the steps
    would favour k > 0 at batch 64, where speculating loses."""
    for num_decodes in (1, 64):
        fixed = {
            k: _throughput_with_prefill(SpeculationPolicy(k, adaptive=False), num_decodes)
            for k in (0, 4)
        }
        policy = SpeculationPolicy(4)
        adaptive = _throughput_with_prefill(policy, num_decodes)
        assert adaptive >= 0.95 * fixed[0], (num_decodes, fixed, adaptive)
        assert adaptive >= 0.88 * max(fixed.values()), (num_decodes, fixed, adaptive)
    assert policy.choose(64) == 0


class _ScriptedPolicy:
    """Asks for 2 drafts on the first decode step, then none; records what it is told."""

    def __init__(self) -> None:
        self.calls = 0
        self.observed: list[tuple[int, float]] = []  # (k, seconds)

    def choose(self, num_decodes: int) -> int:
        self.calls += 1
        return 2 if self.calls == 2 else 0

    def observe(self, num_decodes, k, num_generated, seconds, num_prefill_tokens=0) -> None:
        self.observed.append((k, seconds))


def test_proposing_that_yields_no_drafts_is_billed_to_the_k_asked_for() -> None:
    """A proposer asked for k that returns nothing (every request still catching up) spent
    its time on that k: the next step is charged it as a k = 2 step, not a k = 0 one."""
    policy = _ScriptedPolicy()
    scheduler = Scheduler(
        KVCacheManager(64, 16),
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=256,
        spec_policy=policy,  # type: ignore[arg-type]
    )
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    scheduler.add_request(Request("r", list(range(1, 9)), params, max_tokens=8))
    for _ in range(4):
        out = scheduler.schedule()
        output = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[7]])
        if out.num_spec_tokens_to_propose:
            output.propose_seconds = 0.5  # a catch-up, and no drafts
        OutputApplier(scheduler).update_from_output(out, output)
        scheduler.observer.ran(0.01 + output.propose_seconds, output)
    assert [k for k, _ in policy.observed[1:]] == [0, 2, 0]
    assert [round(s, 3) for _, s in policy.observed[1:]] == [0.01, 0.51, 0.01]


def _losing_step(num_decodes: int, k: int, rng: random.Random) -> tuple[int, float]:
    """A machine where drafting never pays (issue 48's CPU at batch 1 and up): a step costs
    1 ms + 0.1 ms per token verified; drafting 0.5 ms (a catch-up) and each draft step
    0.3 ms + 0.02 ms per request more (drafts of a batch run together); 70 % of drafts
    accepted. Every k >= 1 runs at 0.9x of off or less, at every batch size."""
    tokens, _ = simulated_step(num_decodes, k, rng)
    drafting = 0.0005 * (k > 0) + k * (0.0003 + 0.00002 * num_decodes)
    seconds = 0.001 + 0.0001 * num_decodes * (k + 1) + drafting
    return tokens, seconds * rng.uniform(0.9, 1.1)


def _run(policy: SpeculationPolicy, batches: list[int], step, seed: int = 0) -> float:
    rng = random.Random(seed)
    total_tokens, total_seconds = 0, 0.0
    for num_decodes in batches:
        k = policy.choose(num_decodes)
        tokens, seconds = step(num_decodes, k, rng)
        policy.observe(num_decodes, k, tokens, seconds)
        total_tokens += tokens
        total_seconds += seconds
    return total_tokens / total_seconds


def test_a_batch_that_measured_speculation_losing_turns_it_off_for_larger_ones() -> None:
    """Once batch 1 found every k slower than k = 0, batches of 16 and 64 draft in one step
    of `max_explore_every` only (k = 1), while batch 1 itself keeps exploring as before."""
    policy = SpeculationPolicy(4)
    _run(policy, [1] * 200, _losing_step)
    assert policy.off_above() == 1
    for n in (16, 64):
        chosen = []
        for _ in range(384):
            chosen.append(policy.choose(n))
            policy.observe(n, chosen[-1], *_losing_step(n, chosen[-1], random.Random(0)))
        assert set(chosen) == {0, 1} and chosen.count(1) == 3, (n, chosen.count(1))
    assert {policy.choose(1) for _ in range(300)} > {0}  # still exploring at batch 1


def test_larger_batches_are_freed_when_drafting_starts_to_pay() -> None:
    """The off switch follows the smallest losing batch: when batch 1's drafts start to win
    (easier text), batch 16 measures for itself again."""
    policy = SpeculationPolicy(4)
    _run(policy, [1] * 200, _losing_step)
    assert policy.choose(16) == 0
    _run(policy, [1] * 600, simulated_step)  # drafts now nearly free: k >= 1 wins at batch 1
    assert policy.off_above() is None
    assert policy.choose(1) > 0
    _run(policy, [16] * 20, simulated_step)
    assert any(b == SpeculationPolicy.bucket(16) and k > 0 for b, k in policy.fits)


def test_adaptive_stays_at_the_speed_of_off_where_drafting_loses() -> None:
    """Runs like the benchmark's at concurrency 16 and 64: the batch shrinks as requests
    finish (so each run crosses every batch-size bucket), five runs on one policy. Where no
    k pays, adaptive speculation must run within 3 % of no speculation over all the runs."""
    for concurrency in (16, 64):
        batches = [max(concurrency - step // 3, 1) for step in range(3 * concurrency)] * 5
        off = _run(SpeculationPolicy(0, adaptive=False), batches, _losing_step, concurrency)
        adaptive = _run(SpeculationPolicy(4), batches, _losing_step, concurrency)
        assert adaptive >= 0.97 * off, (concurrency, adaptive / off)


def test_a_larger_batchs_own_gain_lifts_the_switch() -> None:
    """Batch 1 loses, but batch 16 measured k = 1 at twice k = 0's rate: it speculates."""
    policy = SpeculationPolicy(4)
    _run(policy, [1] * 200, _losing_step)
    for _ in range(4):
        policy.observe(16, 0, 16, 0.002)
        policy.observe(16, 1, 32, 0.002)
    assert policy.off_above() == 1
    assert [policy.choose(16) for _ in range(8)].count(1) >= 7
