"""Prefill limits in the scheduler, driven by a fake cost model (no tensors): an ITL target,
vLLM's long-prefill token threshold and its cap on partial prefills."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import expected_output, fake_run, make_request

from tokenmill.core.feedback.cost_model import StepShape, chunk_context
from tokenmill.core.feedback.prefill_budget import (
    PREFILL_FLOOR_SHARE,
    PredictionError,
    PrefillLimits,
)
from tokenmill.core.kv.cache_manager import KVCacheManager
from tokenmill.core.sched.output_applier import OutputApplier
from tokenmill.core.sched.scheduler import Scheduler
from tokenmill.step.runner_output import ModelRunnerOutput
from tokenmill.step.scheduler_output import SchedulerOutput


@dataclass
class LinearCost:
    """A fake cost model with known coefficients (seconds)."""

    fixed: float = 0.010
    per_decode: float = 0.001
    per_prefill: float = 0.0005
    per_context: float = 0.0
    observed: list[tuple[StepShape, float]] = field(default_factory=list)

    def predict(self, shape: StepShape) -> float:
        return (
            self.fixed
            + self.per_decode * shape.num_decode_tokens
            + self.per_prefill * shape.num_prefill_tokens
            + self.per_context * shape.num_prefill_context
        )

    def observe(self, shape: StepShape, seconds: float) -> None:
        self.observed.append((shape, seconds))


def make_scheduler(
    cost: LinearCost | None = None,
    itl_target: float | None = None,
    max_num_batched_tokens: int = 256,
    max_model_len: int = 4096,
    **limits: int,
) -> Scheduler:
    return Scheduler(
        KVCacheManager(4096, 4),
        max_num_seqs=64,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        prefill_limits=PrefillLimits(itl_target=itl_target, cost_model=cost, **limits),
    )


@dataclass
class StepView:
    """One scheduled step as the cost model sees it, and its prompt chunks."""

    shape: StepShape
    chunks: dict[str, int]  # request id -> prompt tokens this step
    num_partial: int  # chunks that leave part of their prompt for later


def view(scheduler: Scheduler, out: SchedulerOutput) -> StepView:
    shape, chunks, num_partial = StepShape(), {}, 0
    new_ids = {r.req_id for r in out.scheduled_new_reqs}
    for req_id, num in out.num_scheduled_tokens.items():
        request = scheduler.requests[req_id]
        num_left = request.num_tokens - request.num_computed_tokens
        if num_left == 1 and req_id not in new_ids:  # a decode
            shape = StepShape(shape.num_decode_tokens + num, *shape.features()[2:])  # type: ignore[arg-type]
            continue
        shape = shape.plus_chunk(num, request.num_computed_tokens)
        chunks[req_id] = num
        num_partial += num < num_left
    return StepView(shape, chunks, num_partial)


def run(
    scheduler: Scheduler, max_steps: int = 20_000
) -> tuple[dict[str, list[int]], list[StepView]]:
    outputs: dict[str, list[int]] = {r: [] for r in scheduler.requests}
    steps = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        out = scheduler.schedule()
        steps.append(view(scheduler, out))
        for core_output in OutputApplier(scheduler).update_from_output(
            out, fake_run(scheduler, out)
        ):
            outputs[core_output.req_id] += core_output.new_token_ids
    assert not scheduler.has_unfinished_requests(), "requests never finished"
    return outputs, steps


@settings(max_examples=60, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 8)), min_size=1, max_size=10),
    target_ms=st.floats(0.1, 200.0),
    per_context_us=st.floats(0.0, 5.0),
    threshold=st.sampled_from([0, 0, 8, 50]),
    max_partial=st.integers(1, 3),
    budget=st.sampled_from([32, 256, 2048]),
)
def test_no_step_is_predicted_over_target_except_the_progress_floor(
    prompts, target_ms, per_context_us, threshold, max_partial, budget
) -> None:
    cost = LinearCost(per_context=per_context_us * 1e-6)
    scheduler = make_scheduler(
        cost,
        target_ms / 1000,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
        max_num_partial_prefills=max_partial,
    )
    requests = [make_request(f"r{i}", n, max_tokens=m) for i, (n, m) in enumerate(prompts)]
    for request in requests:
        scheduler.add_request(request)
    outputs, steps = run(scheduler)
    for step in steps:
        if step.shape.num_prefill_tokens and cost.predict(step.shape) > target_ms / 1000:
            assert within_floor(cost, step), step
        assert step.num_partial <= max_partial, step
        if threshold:
            assert all(n <= threshold for n in step.chunks.values()), step
    assert outputs == {r.sample_id: expected_output(r) for r in requests}


def decodes_only(shape: StepShape) -> StepShape:
    return StepShape(num_decode_tokens=shape.num_decode_tokens)


def within_floor(cost: LinearCost, step: StepView) -> bool:
    """Whether a step's prompt chunks fit the progress floor: one chunk whose predicted time
    is at most the floor's share of the decodes' time (or a single token, the least
    progress)."""
    decodes = cost.predict(decodes_only(step.shape))
    added = cost.predict(step.shape) - decodes
    floor = PREFILL_FLOOR_SHARE * decodes
    return len(step.chunks) == 1 and (added <= floor + 1e-12 or step.shape.num_prefill_tokens == 1)


def test_chunks_shrink_as_the_context_they_attend_to_grows() -> None:
    # 20 ms of decodes, a 40 ms target: 20 ms for prefill, whose context cost grows.
    cost = LinearCost(fixed=0.004, per_decode=0.001, per_prefill=0.0001, per_context=1e-6)
    scheduler = make_scheduler(cost, 0.040, max_num_batched_tokens=2048, max_model_len=4096)
    for i in range(16):
        scheduler.add_request(make_request(f"d{i}", 4, max_tokens=400))
    run_steps(scheduler, 1)
    scheduler.add_request(make_request("long", 3000, max_tokens=1))
    chunks = []
    while "long" in scheduler.requests:
        out = scheduler.schedule()
        step = view(scheduler, out)
        assert cost.predict(step.shape) <= 0.040 or within_floor(cost, step)
        assert step.shape.num_decode_tokens == 16  # every stream got its token
        chunks.append(step.chunks.get("long", 0))
        OutputApplier(scheduler).update_from_output(out, fake_run(scheduler, out))
    assert sum(chunks) == 3000
    assert chunks[0] > 2 * chunks[-2] > 0, chunks


def run_steps(scheduler: Scheduler, num_steps: int) -> None:
    for _ in range(num_steps):
        out = scheduler.schedule()
        OutputApplier(scheduler).update_from_output(out, fake_run(scheduler, out))


def test_a_long_prompt_finishes_with_a_tiny_target() -> None:
    # The decodes alone take 12x the target: prompts still move by the floor every step, half
    # the decodes' 12 ms: 6 ms, 12 prompt tokens at 0.5 ms.
    cost = LinearCost(fixed=0.004, per_decode=0.001)
    scheduler = make_scheduler(cost, 0.001, max_model_len=4096)
    for i in range(8):
        scheduler.add_request(make_request(f"d{i}", 4, max_tokens=100))
    run_steps(scheduler, 1)
    scheduler.add_request(make_request("long", 400, max_tokens=3))
    outputs, steps = run(scheduler)
    assert len(outputs["long"]) == 3
    chunks = [s.chunks["long"] for s in steps if "long" in s.chunks]
    assert chunks == [12] * 33 + [4]


def test_the_floor_is_time_so_chunks_deep_in_a_long_context_shrink() -> None:
    # Decodes take the whole 20 ms target; the floor chunk's cost, context included, stays
    # within half of it (10 ms: 19 tokens at the start), so late chunks are a fraction of
    # the first (a floor counted in tokens costs 1 + 2000 * 1e-6 / 0.5e-3 = 5x more late).
    cost = LinearCost(fixed=0.004, per_decode=0.002, per_prefill=0.0005, per_context=1e-6)
    scheduler = make_scheduler(cost, 0.020, max_num_batched_tokens=2048, max_model_len=4096)
    for i in range(8):
        scheduler.add_request(make_request(f"d{i}", 4, max_tokens=1500))
    run_steps(scheduler, 8)  # the streams' prompts go in by the floor too
    scheduler.add_request(make_request("long", 2000, max_tokens=1))
    chunks = []
    while "long" in scheduler.requests:
        out = scheduler.schedule()
        step = view(scheduler, out)
        assert within_floor(cost, step), step
        assert step.shape.num_decode_tokens == 8  # no stream waits, none was preempted
        chunks.append(step.chunks["long"])
        OutputApplier(scheduler).update_from_output(out, fake_run(scheduler, out))
    assert sum(chunks) == 2000
    assert chunks[0] == 19 and chunks[-2] < chunks[0] / 2, chunks


def test_without_limits_a_step_takes_the_whole_token_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=256)
    scheduler.add_request(make_request("long", 400, max_tokens=1))
    assert scheduler.schedule().num_scheduled_tokens == {"long": 256}


def test_long_prefill_threshold_caps_each_requests_chunk() -> None:
    scheduler = make_scheduler(long_prefill_token_threshold=64, max_num_partial_prefills=2)
    scheduler.add_request(make_request("a", 200, max_tokens=1))
    scheduler.add_request(make_request("b", 200, max_tokens=1))
    scheduler.add_request(make_request("c", 200, max_tokens=1))
    # Two prompts may be cut in one step; the third waits for one of them.
    assert scheduler.schedule().num_scheduled_tokens == {"a": 64, "b": 64}


def test_short_prompts_pass_while_one_long_prompt_is_in_prefill() -> None:
    scheduler = make_scheduler(long_prefill_token_threshold=64, max_num_partial_prefills=1)
    scheduler.add_request(make_request("long", 1000, max_tokens=1))
    run_steps(scheduler, 1)
    scheduler.add_request(make_request("short", 30, max_tokens=1))
    scheduler.add_request(make_request("big", 500, max_tokens=1))
    # The long prompt keeps its 64 tokens, the short one comes in whole, and the second long
    # prompt waits: only one prompt may be cut per step.
    assert scheduler.schedule().num_scheduled_tokens == {"long": 64, "short": 30}


def test_observed_step_times_reach_the_cost_model_and_count_steps_over_target() -> None:
    cost = LinearCost()
    scheduler = make_scheduler(cost, 0.050)
    scheduler.add_request(make_request("a", 40, max_tokens=3))
    for seconds in (0.030, 0.070):
        out = scheduler.schedule()
        shape = view(scheduler, out).shape
        OutputApplier(scheduler).update_from_output(out, fake_run(scheduler, out))
        scheduler.observer.stepped(seconds, ModelRunnerOutput([], []), 0.0)
        assert cost.observed[-1] == (shape, seconds)
    stats = scheduler.get_stats().itl_target
    assert stats is not None and stats.num_steps_over_target == 1
    assert stats.budget_sum == 40 and sum(stats.budget_bucket_counts) == 1


def test_a_moved_target_sizes_the_next_chunks_and_counts_steps_over_it() -> None:
    cost = LinearCost()  # 10 ms + 0.5 ms per prompt token
    scheduler = make_scheduler(cost, 0.020, max_num_batched_tokens=4096)
    scheduler.add_request(make_request("long", 1000, max_tokens=1))
    for target, chunk in ((0.0201, 20), (0.0601, 100)):
        scheduler.set_itl_target(target)
        out = scheduler.schedule()
        assert out.num_scheduled_tokens == {"long": chunk}
        OutputApplier(scheduler).update_from_output(out, fake_run(scheduler, out))
    scheduler.observer.stepped(
        0.050, ModelRunnerOutput([], []), 0.0
    )  # over the first target, within the second
    stats = scheduler.get_stats().itl_target
    assert stats is not None and stats.itl_target == 0.0601 and stats.num_steps_over_target == 0


def test_a_target_cannot_be_set_on_a_scheduler_started_without_one() -> None:
    with pytest.raises(ValueError, match="without an ITL target"):
        make_scheduler().set_itl_target(0.1)
    with pytest.raises(ValueError, match="positive"):
        make_scheduler(LinearCost(), 0.05).set_itl_target(0.0)


def test_steps_that_run_over_their_prediction_shrink_later_chunks() -> None:
    """Steps with prompt tokens that keep taking 1.5x their prediction make the scheduler size
    chunks for target / 1.5, so that most steps, not half, land within the target."""
    cost = LinearCost(fixed=0.004, per_decode=0.001, per_prefill=0.0001)
    scheduler = make_scheduler(cost, 0.040, max_num_batched_tokens=4096, max_model_len=8192)
    scheduler.add_request(make_request("long", 8000, max_tokens=1))
    predictions = []
    for _ in range(9):
        out = scheduler.schedule()
        predicted = cost.predict(view(scheduler, out).shape)
        predictions.append(predicted)
        OutputApplier(scheduler).update_from_output(out, fake_run(scheduler, out))
        scheduler.observer.stepped(1.5 * predicted, ModelRunnerOutput([], []), 0.0)
    assert 0.0398 <= predictions[0] <= 0.040  # sized to the target while nothing is known
    assert scheduler.prefill_limits.prediction_error.factor == 1.5
    assert 0.040 / 1.5 - 0.0002 <= predictions[-1] <= 0.040 / 1.5


def test_prediction_error_is_an_upper_quantile_between_one_and_its_cap() -> None:
    error = PredictionError(window=10, quantile=0.9, cap=2.0, min_steps=4)
    for ratio in (1.2, 1.2, 1.2):
        error.observe(1.0, ratio)
    assert error.factor == 1.0  # too few steps to judge
    for ratio in (0.5, 0.6, 0.7, 0.8, 0.9, 1.3, 1.2):
        error.observe(2.0, 2 * ratio)
    assert error.factor == 1.3  # the 90th percentile of the last ten ratios
    for _ in range(10):
        error.observe(1.0, 0.5)
    assert error.factor == 1.0  # faster than predicted: the target is not raised
    for _ in range(10):
        error.observe(1.0, 9.0)
    assert error.factor == 2.0


def test_chunk_context_counts_causal_positions() -> None:
    assert chunk_context(3, 0) == 1 + 2 + 3
    assert chunk_context(2, 10) == 11 + 12
