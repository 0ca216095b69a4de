"""`serve --data-parallel-size`: a killed replica is restarted, and SIGTERM drains through the
replicas (every open request gets its ending, the router logs no traceback)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
from router_utils import child_pids, wait_gone
from server_utils import API_KEY, MODEL, Server, scrape, start_server, stop_server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# Short enough that the 2,000-token requests are still running when it ends, however fast the
# machine (a quiet 2-core Xeon finished some of them inside 4 s).
GRACE_SECONDS = 1
NUM_STREAMS = 6
NUM_PLAIN = 2
LONG = {"model": MODEL, "prompt": "Long", "max_tokens": 2000, "ignore_eos": True}


def test_a_killed_replica_is_restarted_and_sigterm_drains_through_the_replicas(
    model_dir: Path, tmp_path: Path
) -> None:
    server = start_server(
        model_dir, tmp_path / "serve.log",
        "--data-parallel-size", "2", "--health-check-interval", "0.5",
        "--max-model-len", "2048", "--shutdown-timeout", str(GRACE_SECONDS),
        timeout=600,
    )  # fmt: skip
    try:
        replicas = _restarts_a_killed_replica(server)
        _drains_on_sigterm(server)
        assert not wait_gone(replicas), "replicas outlived the command"
    finally:
        stop_server(server)


def _restarts_a_killed_replica(server: Server) -> list[int]:
    victim, survivor = child_pids(server.process.pid)
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 300
    while True:
        assert time.monotonic() < deadline, f"the replica was not restarted:\n{server.log}"
        replicas = child_pids(server.process.pid)
        health = httpx.get(f"{server.url}/health", timeout=5)
        back = len(replicas) == 2 and victim not in replicas and health.status_code == 200
        if back and health.json() == {"healthy_replicas": 2, "replicas": 2}:
            break
        time.sleep(0.2)
    assert survivor in replicas
    assert "exited with status -9; restarting it in" in server.log
    assert "restarted the replica on port" in server.log
    return replicas


def _drains_on_sigterm(server: Server) -> None:
    url = f"{server.url}/v1/completions"
    streams: list[list[str]] = [[] for _ in range(NUM_STREAMS)]
    plain: list[httpx.Response] = []

    def stream(events: list[str]) -> None:
        body = {**LONG, "stream": True}
        try:
            with httpx.stream("POST", url, json=body, headers=HEADERS, timeout=120) as response:
                events.extend(line[6:] for line in response.iter_lines() if line[:6] == "data: ")
        except httpx.HTTPError as e:
            events.append(f"cut: {e!r}")

    def plain_request() -> None:
        plain.append(httpx.post(url, json=LONG, headers=HEADERS, timeout=120))

    threads = [threading.Thread(target=stream, args=(events,)) for events in streams]
    threads += [threading.Thread(target=plain_request) for _ in range(NUM_PLAIN)]
    for thread in threads:
        thread.start()
    _wait_for_running(server, NUM_STREAMS + NUM_PLAIN)
    server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(120)

    for events in streams:  # cut by the replicas' grace period, with an ending
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert "shutting down" in error["message"]
    assert len(plain) == NUM_PLAIN
    for response in plain:
        assert response.status_code == 503
        assert "shutting down" in response.json()["error"]["message"]
    assert server.process.wait(60) in (0, -signal.SIGTERM)
    assert "Traceback" not in server.log


def _wait_for_running(server: Server, num_running: int) -> None:
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=server.url, headers=HEADERS) as client:
        while True:
            metrics = scrape(client)
            running = sum(
                v for k, v in metrics.items() if k.startswith("tokenmill:num_requests_running{")
            )
            if running >= num_running:
                return
            assert time.monotonic() < deadline, f"never saw {num_running} requests running"
            time.sleep(0.05)
