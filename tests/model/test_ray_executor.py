"""`--distributed-executor-backend ray`: tensor- and pipeline-parallel ranks as Ray actors on a
local Ray instance (one per session, 2 CPUs) give the greedy tokens of one process; a
killed actor fails the engine clearly; what Ray cannot do is refused in one line. Skipped where
Ray is not installed or cannot start."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from collections.abc import Iterator

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.worker.launchers import worker_launcher
from tokenmill.worker.tp_executor import TensorParallelError

pytestmark = pytest.mark.slow(reason="starts a local Ray instance and its actors")

ENGINE = {"dtype": "float32", "max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 12}
PROMPTS = [[random.Random(i).randrange(10, 1000) for _ in range(9 + 5 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="session")
def ray_instance() -> Iterator[None]:
    """One local Ray instance for the session (ray.init takes seconds)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tokenmill[ray]')")
    try:
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    except Exception as e:  # no shared memory, no ports: an environment without Ray
        pytest.skip(f"a local Ray instance cannot start here: {e}")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama", vocab_size=1021))  # the last rank's vocabulary pads


@pytest.fixture(scope="module")
def ray_engine(ray_instance, checkpoint) -> Iterator[LLM]:
    """One engine over Ray for the module: its tokens are checked, then a rank is killed."""
    llm = LLM(checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    yield llm
    llm.engine.shutdown()


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_two_pipeline_stages_over_ray_generate_what_one_process_does(
    ray_instance, checkpoint
) -> None:
    """The executor's ranks come from TP x PP, so stages are Ray actors too (run first: one
    distributed engine per process at a time, and the module's TP engine lives to the end)."""
    llm = LLM(checkpoint, pipeline_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    try:
        assert type(llm.engine.parts.executor.workers[0]).__name__ == "RayWorker"
        assert greedy(llm) == greedy(LLM(checkpoint, **ENGINE))
    finally:
        llm.engine.shutdown()


def test_two_ranks_over_ray_generate_what_one_process_does(ray_engine, checkpoint) -> None:
    executor = ray_engine.engine.parts.executor
    assert type(executor.workers[0]).__name__ == "RayWorker"
    assert greedy(ray_engine) == greedy(LLM(checkpoint, **ENGINE))
    assert len(executor.weight_bytes) == 2


def test_a_killed_ray_worker_fails_the_engine_clearly(ray_engine) -> None:
    executor = ray_engine.engine.parts.executor
    failures: list[BaseException] = []
    executor.on_failure = failures.append  # as the async engine listens (and then dies)
    worker = executor.workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(60)
    deadline = time.monotonic() + 60  # a hang guard: the report follows the exit at once
    while not failures and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(failures) == 1 and "rank 1 (Ray actor" in str(failures[0])
    with pytest.raises(TensorParallelError, match=r"rank 1 \(Ray actor .*\) died"):
        ray_engine.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    with pytest.raises(TensorParallelError):  # and stays failed
        ray_engine.generate(PROMPTS[0], GREEDY, use_tqdm=False)


def test_ray_refuses_what_it_does_not_place(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="leave nnodes at 1"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, distributed_executor_backend="ray")
    with pytest.raises(ConfigError, match="distributed_executor_backend"):
        EngineConfig(distributed_executor_backend="slurm")
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed
    monkeypatch.delitem(sys.modules, "tokenmill.worker.ray_workers", raising=False)
    config = EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    with pytest.raises(ConfigError, match=r"needs Ray .*pip install 'tokenmill\[ray\]'"):
        worker_launcher(config, 2)
