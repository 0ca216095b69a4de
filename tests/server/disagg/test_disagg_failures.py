"""Real processes failing around a prefill/decode pair: a prefill instance killed mid-transfer
(the request is prefilled again, then served by the decode instance alone; nothing stays
held), a decode instance that never pulls (the prefill instance frees the blocks at the end of
their lease and keeps serving), and a router whose decode instance is gone (a clear 503, no
hang)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_utils import (
    API_KEY,
    MODEL,
    Server,
    free_port,
    scrape,
    start_server,
    stop_server,
    wait_for,
    wait_healthy,
)

PROMPT = "The lighthouse keeper counted the ships that passed the rocks every night until"
# A prefill instance that dies (SIGKILL) the moment it starts sending a request's KV.
DIES_MID_TRANSFER = """
import os, signal, sys
from tokenmill.kv_transfer.p2p import channel
from tokenmill.entrypoints.cli import main

def send(self, tensor, tag):
    os.kill(os.getpid(), signal.SIGKILL)

channel.PairGroup.send = send
sys.exit(main(sys.argv[1:]))
"""


def p2p(role: str, **extra: float) -> str:
    config = {
        "kv_connector": "P2pConnector",
        "kv_role": role,
        "kv_port": 0,
        "kv_connector_extra_config": {"timeout": 5, **extra},
    }
    return json.dumps(config)


def start_router(prefill: str, decode: str, log_path: Path) -> Server:
    """`tokenmill router --prefill --decode`, not waited for (its /health may be 503)."""
    port = free_port()
    command = [
        sys.executable, "-m", "tokenmill.entrypoints.cli", "router", "--port", str(port),
        "--prefill", prefill, "--decode", decode, "--api-key", API_KEY,
        "--health-check-interval", "0.5",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    return Server(f"http://127.0.0.1:{port}", process, log_path)


def answer_when_up(http: httpx.Client, path: str, timeout: float = 60) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return http.get(path)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def client_for(server: Server) -> httpx.Client:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.Client(base_url=server.url, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def decode(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("decode") / "decode.log"
    server = start_server(model_dir, log_path, "--kv-transfer-config", p2p("kv_consumer"))
    yield server
    stop_server(server)


def completion(http: httpx.Client, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, **extra}
    return http.post("/v1/completions", json=body)


def test_a_prefill_instance_killed_mid_transfer(model_dir: Path, decode: Server, tmp_path) -> None:
    prefill = start_server(
        model_dir, tmp_path / "prefill.log",
        "--kv-transfer-config", p2p("kv_producer"),
        launcher=("-c", DIES_MID_TRANSFER),
    )  # fmt: skip
    router = wait_healthy(start_router(prefill.url, decode.url, tmp_path / "router.log"), 120)
    try:
        with client_for(decode) as direct, client_for(router) as routed:
            expected = completion(direct, cache_salt="reference").json()["choices"][0]["text"]
            response = completion(routed)
            # The KV never arrived; prefilled again, the dead instance refused the connection,
            # so the decode instance served the request whole: the client sees only its answer.
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected
            assert prefill.process.wait(10) == -9  # it died mid-transfer, as injected
            metrics = scrape(routed)
            assert metrics["tokenmill:router_kv_transfer_retries_total"] == 1
            assert metrics['tokenmill:router_disagg_requests_total{mode="decode_only"}'] == 1
            decode_metrics = wait_for(direct, {"tokenmill:kv_cache_usage_perc": 0})
            assert decode_metrics["tokenmill:kv_cache_usage_perc"] == 0  # nothing leaked
            failure = 'tokenmill:kv_transfer_failures_total{direction="recv"}{reason="connection"}'
            assert decode_metrics[failure] >= 1
            # The surviving instance keeps serving, through the router too.
            assert completion(routed).json()["choices"][0]["text"] == expected
    finally:
        stop_server(router)
        stop_server(prefill)


def test_kv_nobody_pulls_is_freed_after_its_lease(model_dir: Path, tmp_path) -> None:
    """A decode instance that died before pulling: the prefill instance holds the blocks for
    `kv_lease_duration` seconds, then gives them back, and serves on meanwhile."""
    prefill = start_server(
        model_dir, tmp_path / "prefill.log",
        "--kv-transfer-config", p2p("kv_producer", kv_lease_duration=2),
    )  # fmt: skip
    try:
        with client_for(prefill) as http:
            params = {"do_remote_decode": True}
            answer = completion(http, max_tokens=1, ignore_eos=True, kv_transfer_params=params)
            assert answer.json()["kv_transfer_params"]["do_remote_prefill"] is True
            assert scrape(http)["tokenmill:kv_cache_usage_perc"] > 0  # held for the consumer
            assert completion(http).status_code == 200  # serving on meanwhile
            metrics = wait_for(
                http,
                {
                    "tokenmill:kv_cache_usage_perc": 0,
                    "tokenmill:kv_connector_expired_requests_total": 1,
                },
                timeout=30,
            )
            assert metrics["tokenmill:kv_cache_usage_perc"] == 0
            assert metrics["tokenmill:kv_connector_expired_requests_total"] == 1
    finally:
        stop_server(prefill)


def test_a_router_whose_decode_instance_is_gone_answers_503(decode: Server, tmp_path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = start_router(decode.url, dead, tmp_path / "router.log")  # any prefill will do
    try:
        with client_for(router) as http:
            health = answer_when_up(http, "/health")
            assert health.status_code == 503
            assert health.json()["error"]["code"] == "no_healthy_replica"
            response = completion(http)
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "no_healthy_replica"
        assert router.process.poll() is None  # the router itself stays up
    finally:
        stop_server(router)
