"""`serve --data-parallel-size 2 --data-parallel-backend ray`: two replicas held by Ray actors
on a local two-node Ray cluster (this module's), one per node, answer what one process
generates; a killed replica and a killed actor are each reported and replaced, as the mp
backend's replicas are. Skipped where Ray is not installed or cannot start."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import API_KEY, MODEL, Server, scrape, start_server, stop_server

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow(reason="starts a local Ray cluster and two replicas on it")

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = [[11 + 7 * i + j for j in range(5 + 3 * i)] for i in range(4)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    """A local Ray cluster of two nodes (two raylets, 2 CPUs each) for the module; the command
    joins it through RAY_ADDRESS."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'tokenmill[ray]')")
    from ray.cluster_utils import Cluster

    try:
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
        )
        cluster.add_node(num_cpus=2)
    except Exception as e:  # no shared memory, no ports: an environment without Ray
        pytest.skip(f"a local Ray cluster cannot start here: {e}")
    yield cluster.address
    cluster.shutdown()


@pytest.fixture(scope="module")
def served(ray_address: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log_path = tmp_path_factory.mktemp("ray-replicas") / "serve.log"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_ADDRESS", ray_address)
        server = start_server(
            model_dir, log_path,
            "--data-parallel-size", "2", "--data-parallel-backend", "ray",
            "--routing-policy", "round-robin", "--health-check-interval", "0.5",
            timeout=600,
        )  # fmt: skip
    yield server
    stop_server(server)


def replica_pids(server: Server) -> list[int]:
    """The replicas' pids, from the command's start-up line (both nodes are this machine)."""
    found = re.search(r"started 2 replicas as Ray actors \(pids (\d+), (\d+)", server.log)
    assert found, server.log
    return [int(found[1]), int(found[2])]


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_replicas_on_ray_generate_what_one_process_does(served: Server, model_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    single = LLM(str(model_dir), max_model_len=256)
    expected = [o.outputs[0].text for o in single.generate(PROMPTS, params, use_tqdm=False)]
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=served.url, headers=HEADERS, timeout=120) as client:
        texts = [
            client.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"]
            for p in PROMPTS
        ]
        counts = {
            key: value
            for key, value in scrape(client).items()
            if key.startswith("tokenmill:router_requests_total")
        }
    assert texts == expected
    # Round-robin sent two requests to each replica, at its node's address, not loopback.
    assert sorted(counts.values()) == [2.0, 2.0], counts
    assert all("127.0.0.1" not in key for key in counts), counts
    # Each held by a Ray actor (not by the command), the two spread over the two nodes: their
    # actors' parents are two raylets.
    actors = [parent(pid) for pid in replica_pids(served)]
    assert all(b"ReplicaHost" in Path(f"/proc/{a}/cmdline").read_bytes() for a in actors)
    raylets = {parent(actor) for actor in actors}
    assert len(raylets) == 2
    assert all(b"raylet" in Path(f"/proc/{r}/cmdline").read_bytes() for r in raylets)


def test_a_killed_replica_and_a_killed_actor_are_reported_and_replaced(served: Server) -> None:
    victim, _ = replica_pids(served)
    actor = parent(victim)
    os.kill(victim, signal.SIGKILL)
    wait_for_two_healthy(served, f"(pid {victim}) exited with status -9; restarting it in", 1)
    os.kill(actor, signal.SIGKILL)  # its replica gets the parent-death signal
    wait_for_two_healthy(served, "was lost with its Ray actor", 2)


def wait_for_two_healthy(server: Server, reported: str, restarts: int) -> None:
    """Until `reported` is logged, the `restarts`-th restart too, and both replicas answer."""
    deadline = time.monotonic() + 300
    while True:
        assert time.monotonic() < deadline, f"never reported and healthy again:\n{server.log}"
        log = server.log
        if reported in log and log.count("restarted the replica on port") == restarts:
            health = httpx.get(f"{server.url}/health", timeout=5)
            if health.status_code == 200 and health.json() == {
                "healthy_replicas": 2,
                "replicas": 2,
            }:
                return
        time.sleep(0.2)
