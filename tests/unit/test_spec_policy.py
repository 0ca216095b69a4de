"""The adaptive speculation policy gets close to the best fixed k, whichever that is."""

from __future__ import annotations

import random

from tokenmill.spec_decode.policy import SpeculationPolicy


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
