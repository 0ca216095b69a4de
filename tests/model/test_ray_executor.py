"""`--distributed-executor-backend ray`: tensor- and pipeline-parallel ranks as Ray actors on a
local two-node Ray cluster (one per session, 2 + 2 CPUs: Ray counts them, the ranks share the
machine's) give the greedy tokens of one process for TP=2, PP=2 and TP=2 x PP=2 (its four
ranks over both nodes); a killed actor fails the engine clearly, and under the server ends the
requests in flight with an error and fails /health; what Ray cannot do is refused in one line.
Skipped where Ray is not installed or cannot start."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError, EngineConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.entrypoints.http.app import build_app
from tokenmill.entrypoints.http.context import ServerContext
from tokenmill.worker.launchers import worker_launcher
from tokenmill.worker.tp_executor import TensorParallelError

pytestmark = pytest.mark.slow(reason="starts a local Ray instance and its actors")

ENGINE = {"dtype": "float32", "max_model_len": 64, "block_size": 4, "max_num_batched_tokens": 12}
PROMPTS = [[random.Random(i).randrange(10, 1000) for _ in range(9 + 5 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="session")
def ray_instance() -> Iterator[None]:
    """One local Ray cluster of two nodes (two raylets, 2 CPUs each) for the session, joined
    by this process (starting one takes seconds)."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tokenmill[ray]')")
    from ray.cluster_utils import Cluster

    try:
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
        )
        cluster.add_node(num_cpus=2)
        ray.init(address=cluster.address, logging_level="WARNING")
    except Exception as e:  # no shared memory, no ports: an environment without Ray
        pytest.skip(f"a local Ray cluster cannot start here: {e}")
    yield
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama", vocab_size=1021))  # the last rank's vocabulary pads


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[int]]:
    return greedy(LLM(checkpoint, **ENGINE))


@pytest.fixture(scope="module")
def ray_engine(ray_instance, checkpoint) -> Iterator[LLM]:
    """One engine over Ray for the module: its tokens are checked, then a rank is killed."""
    llm = LLM(checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    yield llm
    llm.engine.shutdown()


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("tp", [1, 2], ids=["pp2", "tp2xpp2"])
def test_pipeline_stages_over_ray_generate_what_one_process_does(
    ray_instance, checkpoint, expected, tp
) -> None:
    """The executor's ranks come from TP x PP, so stages (of one or two tensor ranks) are Ray
    actors too (run first: one distributed engine per process at a time, and the module's TP
    engine lives to the end)."""
    llm = LLM(
        checkpoint,
        tensor_parallel_size=tp,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
        **ENGINE,
    )
    try:
        workers = llm.engine.parts.executor.workers
        assert len(workers) == 2 * tp - 1
        assert {type(w).__name__ for w in workers} == {"RayWorker"}
        # Packed: two ranks fit the engine's node; four take both (the actors' parents are
        # the nodes' raylets).
        assert len({parent(w.pid) for w in workers}) == tp
        assert greedy(llm) == expected
    finally:
        llm.engine.shutdown()


def test_two_ranks_over_ray_generate_what_one_process_does(ray_engine, expected) -> None:
    executor = ray_engine.engine.parts.executor
    assert type(executor.workers[0]).__name__ == "RayWorker"
    assert greedy(ray_engine) == expected
    assert len(executor.weight_bytes) == 2


def test_a_killed_ray_worker_ends_requests_in_flight_and_fails_health(ray_engine) -> None:
    """As `tokenmill serve` runs it (the async engine and the HTTP app, in-process): SIGKILL of
    rank 1's actor while a stream and a plain request decode ends both with `engine_dead`
    naming the Ray actor, /health answers 503, and the engine stays failed."""
    engine = ray_engine.engine
    steps = slow_steps(engine)
    async_engine = AsyncEngine(engine, log_stats_interval=None)
    app = build_app(ServerContext(async_engine, ["m"], "here"), CollectorRegistry(), None)
    body = {"prompt": PROMPTS[0], "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    worker = engine.parts.executor.workers[0]

    async def main() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async_engine.start()  # the ASGI transport runs no lifespan
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            stream = asyncio.create_task(
                client.post("/v1/completions", json={**body, "stream": True}, timeout=120)
            )
            plain = asyncio.create_task(client.post("/v1/completions", json=body, timeout=120))
            deadline = time.monotonic() + 60  # a hang guard
            while steps[0] < 4 and time.monotonic() < deadline:  # both decoding
                await asyncio.sleep(0.01)
            os.kill(worker.pid, signal.SIGKILL)
            return await stream, await plain, await client.get("/health")

    try:
        streamed, plain, health = asyncio.run(main())
    finally:
        async_engine.shutdown()
    actor = r"tensor-parallel worker rank 1 \(Ray actor tokenmill-tp-1, pid \d+ on .*\) died"
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2  # tokens came before the error
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_dead" and re.search(actor, error["message"]), error
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "engine_dead"
    assert re.search(actor, plain.json()["error"]["message"])
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    with pytest.raises(TensorParallelError, match=actor):  # and the engine stays failed
        ray_engine.generate(PROMPTS[0], GREEDY, use_tqdm=False)


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def slow_steps(engine) -> list[int]:
    """Make each engine step take 50 ms more (so requests are still decoding when the test
    kills a rank); returns the running count of steps."""
    real_step, count = engine.step, [0]

    def step():
        time.sleep(0.05)
        count[0] += 1
        return real_step()

    engine.step = step
    return count


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
