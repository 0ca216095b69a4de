"""A short start-up calibration of the step cost model: a few synthetic steps, timed.

The steps span the cost model's features (decode rows alone, prompt chunks with and without
context before them, a mixed step), so the online fit starts from a sane prior instead of
learning from the first real long prompt, whose steps would blow the latency target. The KV
cache is empty at start-up, so the synthetic requests borrow its blocks; what they write is
overwritten by real requests later. Each step runs once to warm up and then twice, and the
faster time counts (interference from other jobs only ever slows a step down).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokenmill.core.feedback.cost_model import StepShape
from tokenmill.sampling_params import SamplingParams
from tokenmill.step.scheduler_output import NewRequestData, SchedulerOutput
from tokenmill.worker.model_runner import ModelRunner

MAX_DECODE_ROWS = 32
NUM_TIMED_RUNS = 2


@dataclass(frozen=True)
class SyntheticRow:
    """One synthetic request of a calibration step: `num_new` tokens after `num_cached`."""

    num_cached: int
    num_new: int


def calibration_steps(max_num_seqs: int, max_model_len: int) -> list[list[SyntheticRow]]:
    """The synthetic steps, sized to fit the engine's limits."""
    rows = max(1, min(MAX_DECODE_ROWS, max_num_seqs))
    context = min(64, max_model_len - 1)
    chunk = min(128, max_model_len)
    small = min(16, max_model_len)
    long_cached = max(0, min(480, max_model_len - 32))
    decodes = [SyntheticRow(context, 1)] * rows
    return [
        [SyntheticRow(context, 1)],
        decodes,
        [SyntheticRow(0, small)],
        [SyntheticRow(0, chunk)],
        [SyntheticRow(long_cached, min(32, max_model_len - long_cached))],
        [SyntheticRow(0, min(64, max_model_len)), *decodes[: max(1, rows - 1)]],
    ]


def calibrate(
    runner: ModelRunner, num_blocks: int, max_num_seqs: int, max_model_len: int
) -> list[tuple[StepShape, float]]:
    """(shape, fastest seconds) of each calibration step that fits the KV cache."""
    samples = []
    for index, rows in enumerate(calibration_steps(max_num_seqs, max_model_len)):
        while rows and _num_blocks(rows, runner.block_size) >= num_blocks:
            rows = rows[:-1]  # a small KV cache: fewer rows
        if not rows:
            continue
        runs = range(1 + NUM_TIMED_RUNS)
        times = [time_synthetic_step(runner, rows, f"calibration-{index}-{run}") for run in runs]
        samples.append((synthetic_step_shape(rows), min(times[1:])))
    return samples


def _num_blocks(rows: list[SyntheticRow], block_size: int) -> int:
    return sum(-(-(r.num_cached + r.num_new) // block_size) for r in rows)


def synthetic_step_shape(rows: list[SyntheticRow]) -> StepShape:
    shape = StepShape(num_decode_tokens=sum(1 for r in rows if r.num_new == 1))
    for row in rows:
        if row.num_new > 1:
            shape = shape.plus_chunk(row.num_new, row.num_cached)
    return shape


def time_synthetic_step(runner: ModelRunner, rows: list[SyntheticRow], prefix: str) -> float:
    """Seconds one synthetic step takes in the runner; it forgets the requests after."""
    new_reqs, next_block = [], 1  # block 0: a hybrid cache's null block, never written
    vocab_size = runner.model.shape.vocab_size
    for i, row in enumerate(rows):
        num_tokens = row.num_cached + row.num_new
        num_blocks = -(-num_tokens // runner.block_size)
        new_reqs.append(
            NewRequestData(
                req_id=f"{prefix}-{i}",
                token_ids=[(7919 * (t + i)) % vocab_size for t in range(num_tokens)],
                num_prompt_tokens=num_tokens,
                sampling_params=SamplingParams(temperature=0.0, max_tokens=1),
                block_ids=list(range(next_block, next_block + num_blocks)),
                num_computed_tokens=row.num_cached,
            )
        )
        next_block += num_blocks
    num_scheduled = {r.req_id: row.num_new for r, row in zip(new_reqs, rows, strict=True)}
    step = SchedulerOutput(new_reqs, [], num_scheduled, sum(num_scheduled.values()))
    if runner.kv_groups is not None:  # a timing run: every group through the same blocks
        num_other = len(runner.kv_groups.windows) - 1
        step.kv_group_block_ids = {r.req_id: [r.block_ids] * num_other for r in new_reqs}
    start = time.perf_counter()
    runner.execute_model(step)
    seconds = time.perf_counter() - start
    runner.execute_model(SchedulerOutput([], [], {}, 0, finished_req_ids=set(num_scheduled)))
    return seconds
