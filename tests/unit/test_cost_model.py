"""The online step cost model: fits measured steps, shrugs off noise, keeps its prior where
recent steps say nothing."""

from __future__ import annotations

import random

import pytest

from tokenmill.core.feedback.cost_model import StepCostModel, StepShape, chunk_context

TRUE = (0.010, 0.0015, 0.0004, 2e-7)  # fixed, per decode, per prompt token, per position


def true_seconds(shape: StepShape, coefficients=TRUE) -> float:
    return sum(c * x for c, x in zip(coefficients, shape.features(), strict=True))


CALIBRATION = [
    StepShape(1),
    StepShape(32),
    StepShape(0, 16, chunk_context(16, 0)),
    StepShape(0, 128, chunk_context(128, 0)),
    StepShape(0, 32, chunk_context(32, 480)),
    StepShape(31, 64, chunk_context(64, 0)),
]


def random_step(rng: random.Random) -> StepShape:
    num_tokens = rng.choice([0, 0, 16, 64, 256])
    return StepShape(32, num_tokens, chunk_context(num_tokens, rng.randrange(4000)))


def calibrated(coefficients=TRUE) -> StepCostModel:
    return StepCostModel.calibrated([(s, true_seconds(s, coefficients)) for s in CALIBRATION])


def test_calibration_recovers_the_coefficients() -> None:
    assert calibrated().coefficients == pytest.approx(TRUE, rel=1e-3)


def test_noisy_steps_with_outliers_still_predict_within_15_percent() -> None:
    rng = random.Random(0)
    model = calibrated((0.005, 0.003, 0.001, 1e-6))  # a poor start
    for _ in range(600):
        shape = random_step(rng)
        seconds = true_seconds(shape) * rng.uniform(0.95, 1.1)
        if rng.random() < 0.1:  # another job took the cores
            seconds *= rng.uniform(2, 5)
        model.observe(shape, seconds)
    for shape in (StepShape(32), StepShape(32, 256, chunk_context(256, 3700))):
        assert model.predict(shape) == pytest.approx(true_seconds(shape), rel=0.15)


def test_a_machine_that_gets_slower_is_followed() -> None:
    rng = random.Random(1)
    model = calibrated()
    slower = tuple(2 * c for c in TRUE)
    for _ in range(300):
        shape = random_step(rng)
        model.observe(shape, true_seconds(shape, slower))
    shape = StepShape(32, 64, chunk_context(64, 1000))
    assert model.predict(shape) == pytest.approx(true_seconds(shape, slower), rel=0.1)


def test_prefill_cost_survives_a_long_run_of_decode_only_steps() -> None:
    model = calibrated()
    for _ in range(2000):
        model.observe(StepShape(32), true_seconds(StepShape(32)))
    shape = StepShape(32, 256, chunk_context(256, 2000))
    assert model.predict(shape) == pytest.approx(true_seconds(shape), rel=0.05)


def test_coefficients_never_go_negative() -> None:
    model = StepCostModel((0.01, 0.001, 0.001, 0.0))
    rng = random.Random(2)
    for _ in range(100):  # prompt tokens that seem to make steps faster: noise
        num_tokens = rng.randrange(64)
        model.observe(StepShape(8, num_tokens), 0.05 - 0.0001 * num_tokens)
    assert min(model.coefficients) >= 0.0


def test_without_calibration_samples_the_model_learns_online() -> None:
    model = StepCostModel.calibrated([])
    rng = random.Random(3)
    for _ in range(200):
        shape = random_step(rng)
        model.observe(shape, true_seconds(shape))
    shape = StepShape(32, 64, chunk_context(64, 500))
    assert model.predict(shape) == pytest.approx(true_seconds(shape), rel=0.05)
