"""A Ray cluster across two "hosts" (network namespaces joined by a veth pair, netns.py): the
head on one (1 CPU), a worker node on the other (2 CPUs), each started with `ray start` as on a
real machine. Tensor parallelism over Ray puts rank 1 on the other host and gives one
process's greedy tokens; `--data-parallel-backend ray` puts a replica on each host, both
answering what one process does. Skipped where namespaces cannot be made or Ray is missing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import Host, two_hosts, unavailable_reason
from server_utils import API_KEY, MAX_MODEL_LEN, MODEL

from tokenmill import LLM, SamplingParams

REASON = unavailable_reason()
if REASON is None and importlib.util.find_spec("ray") is None:
    REASON = "Ray is not installed (pip install 'tokenmill[ray]')"
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
    pytest.mark.slow(reason="starts a two-node Ray cluster in network namespaces"),
]

RAY = (sys.executable, "-m", "ray.scripts.scripts")
RAY_PORT = "6390"
PROMPTS = [[17, 230, 45, 612, 9, 88, 301, 402], [5, 190, 260, 77, 11, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# Rank 0 in this process's namespace: its tokens, and where rank 1 ran.
TP_SCRIPT = """
import json, sys
from tokenmill import LLM, SamplingParams
model, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model, dtype="float32", max_model_len=64, tensor_parallel_size=2,
          distributed_executor_backend="ray")
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
where = llm.engine.parts.executor.workers[0].describe_exit()
llm.engine.shutdown()
print(json.dumps({"tokens": tokens, "rank1": where}))
"""


def env(host: Host, address: str | None = None) -> dict[str, str]:
    """What every Ray process on `host` runs with: gloo on the link, Ray's token auth (which
    `ray start --head` turns on), the cluster's address."""
    extra = {"GLOO_SOCKET_IFNAME": host.interface, "RAY_AUTH_MODE": "token"}
    return {**os.environ, **extra, **({"RAY_ADDRESS": address} if address else {})}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Host, Host, str]]:
    logs = tmp_path_factory.mktemp("ray-hosts")
    with two_hosts() as (a, b):
        address = f"{a.address}:{RAY_PORT}"
        head = a.start(
            [*RAY, "start", "--head", "--node-ip-address", a.address, "--port", RAY_PORT,
             "--num-cpus", "1", "--include-dashboard", "false", "--block"],
            logs / "head.log", env(a),
        )  # fmt: skip
        node = b.start(
            [*RAY, "start", "--address", address, "--node-ip-address", b.address,
             "--num-cpus", "2", "--block"],
            logs / "node.log", env(b),
        )  # fmt: skip
        try:
            wait_for_nodes(a, address, [head, node], logs)
            yield a, b, address
        finally:
            stop([node, head])  # `ray start --block` ends what it started
            current = Path("/tmp/ray/ray_current_cluster")  # else address="auto" finds it
            if current.exists() and current.read_text().strip() == address:
                current.unlink()


def wait_for_nodes(a: Host, address: str, processes: list[subprocess.Popen], logs: Path) -> None:
    """Until the head sees both nodes' 3 CPUs; skip if `ray start` cannot run here."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            tails = [(logs / n).read_text()[-1500:] for n in ("head.log", "node.log")]
            pytest.skip(f"`ray start` exited here: {tails}")
        status = subprocess.run(
            a.command(*RAY, "status", "--address", address), env=env(a), capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
        if "/3.0 CPU" in status.stdout:
            return
        time.sleep(1)
    pytest.fail(f"the two Ray nodes never joined: {(logs / 'node.log').read_text()[-3000:]}")


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=64)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_rank_one_on_the_other_host_gives_one_process_tokens(
    cluster: tuple[Host, Host, str], model_dir: Path, expected: list[list[int]]
) -> None:
    a, b, address = cluster
    command = a.command(sys.executable, "-c", TP_SCRIPT, str(model_dir), json.dumps(PROMPTS))
    done = subprocess.run(command, env=env(a, address), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert f" on {b.address})" in result["rank1"], result  # the head had no CPU left for it
    assert result["tokens"] == expected


def test_a_data_parallel_replica_on_each_host(
    cluster: tuple[Host, Host, str], model_dir: Path, model_text: list[str], tmp_path: Path
) -> None:
    a, b, address = cluster
    server = a.start(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", str(model_dir),
         "--served-model-name", MODEL, "--host", a.address, "--port", "8100",
         "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
         "--data-parallel-size", "2", "--data-parallel-backend", "ray",
         "--routing-policy", "round-robin", "--health-check-interval", "0.5"],
        tmp_path / "serve.log", env(a, address),
    )  # fmt: skip
    try:
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        texts = []
        for prompt in [PROMPTS[0], PROMPTS[0]]:  # round-robin: one on each replica
            answer = a.request(
                f"http://{a.address}:8100", "/v1/completions", {**body, "prompt": prompt},
                API_KEY,
            )  # fmt: skip
            assert answer["status"] == 200, (tmp_path / "serve.log").read_text()[-3000:]
            texts.append(answer["body"]["choices"][0]["text"])
        log = (tmp_path / "serve.log").read_text()
        # One replica on each host, each served at its host's address.
        assert f"http://{a.address}:" in log and f"http://{b.address}:" in log, log[-3000:]
        assert texts == [model_text[0]] * 2
    finally:
        stop([server])


@pytest.fixture(scope="module")
def model_text(model_dir: Path) -> list[str]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
