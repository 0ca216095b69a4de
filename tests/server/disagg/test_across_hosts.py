"""Prefill/decode disaggregation across machines, made of two network namespaces joined by a
veth pair (netns.py): the prefill instance on one "host", the decode instance and the router
on the other, the KV crossing the link over gloo. Skipped where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from netns import Host, two_hosts, unavailable_reason
from server_utils import API_KEY, MAX_MODEL_LEN, MODEL

from tokenmill import LLM, SamplingParams

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

PROMPT = "Far across the valley the old mill turned its wheel through every season, and"
SERVE = (sys.executable, "-m", "tokenmill.entrypoints.cli", "serve")


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[Host, Host]]:
    with two_hosts() as made:
        yield made


def serve_args(model_dir: Path, host: str, port: int, kv: dict) -> list[str]:
    return [
        *SERVE, str(model_dir), "--served-model-name", MODEL, "--host", host,
        "--port", str(port), "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
        "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_prefill_on_one_host_decode_on_another(
    model_dir: Path, hosts: tuple[Host, Host], tmp_path: Path
) -> None:
    a, b = hosts
    producer = {
        "kv_connector": "P2pConnector", "kv_role": "kv_producer",
        "kv_ip": a.address, "kv_port": 14579,
    }  # fmt: skip
    consumer = {"kv_connector": "P2pConnector", "kv_role": "kv_consumer"}
    router = [
        sys.executable, "-m", "tokenmill.entrypoints.cli", "router", "--port", "8002",
        "--prefill", f"http://{a.address}:8000", "--decode", "http://127.0.0.1:8001",
        "--api-key", API_KEY, "--health-check-interval", "0.5",
    ]  # fmt: skip
    processes = [
        a.start(serve_args(model_dir, a.address, 8000, producer), tmp_path / "prefill.log"),
        b.start(serve_args(model_dir, "127.0.0.1", 8001, consumer), tmp_path / "decode.log"),
        b.start(router, tmp_path / "router.log"),
    ]
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        # The decode instance alone computes the prompt itself (another salt: no sharing).
        salted = {**body, "cache_salt": "x"}
        alone = b.request("http://127.0.0.1:8001", "/v1/completions", salted, API_KEY)
        assert alone["status"] == 200, alone
        # Reaching the prefill instance across the link proves the hosts are joined.
        assert b.request(f"http://{a.address}:8000", "-", None, API_KEY)["status"] == 200
        answer = b.request("http://127.0.0.1:8002", "/v1/completions", body, API_KEY)
        assert answer["status"] == 200, answer
        choice = answer["body"]["choices"][0]
        assert choice["text"] == alone["body"]["choices"][0]["text"]
        usage = answer["body"]["usage"]
        # Every prompt token but the last was loaded from the other host, not computed.
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    finally:
        stop(processes)


def test_tensor_parallel_with_one_rank_per_host(
    model_dir: Path, hosts: tuple[Host, Host], tmp_path: Path
) -> None:
    """`--tensor-parallel-size 2 --nnodes 2`: rank 0 (the server) on one host, rank 1 started
    by `tokenmill tp-worker` on the other; they meet at MASTER_ADDR:MASTER_PORT and their
    collectives cross the link (gloo on the link's interface). Greedy text equals one rank's."""
    a, b = hosts
    prompt = [17, 230, 45, 612, 9, 88, 301, 402, 77, 5, 190, 260]
    expected = (
        LLM(model=str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
        .generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    rank0_env = {
        **os.environ, "MASTER_ADDR": a.address, "MASTER_PORT": "29500",
        "GLOO_SOCKET_IFNAME": a.interface,
    }  # fmt: skip
    rank1_env = {**os.environ, "GLOO_SOCKET_IFNAME": b.interface}
    server = [
        *SERVE, str(model_dir), "--served-model-name", MODEL, "--host", a.address,
        "--port", "8100", "--api-key", API_KEY, "--max-model-len", str(MAX_MODEL_LEN),
        "--tensor-parallel-size", "2", "--nnodes", "2", "--num-kv-blocks", "64",
    ]  # fmt: skip
    worker = [
        sys.executable, "-m", "tokenmill.entrypoints.cli", "tp-worker",
        "--master-addr", a.address, "--master-port", "29500", "--node-rank", "1",
    ]  # fmt: skip
    processes = [
        a.start(server, tmp_path / "rank0.log", rank0_env),
        b.start(worker, tmp_path / "rank1.log", rank1_env),
    ]
    try:
        body = {
            "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True,
        }  # fmt: skip
        answer = b.request(f"http://{a.address}:8100", "/v1/completions", body, API_KEY)
        assert answer["status"] == 200, (answer, (tmp_path / "rank0.log").read_text()[-3000:])
        assert answer["body"]["choices"][0]["text"] == expected
    finally:
        stop(processes[:1])  # the server stops its ranks, the remote one too...
        try:
            assert processes[1].wait(60) == 0  # ...which exits when told, cleanly
        finally:
            stop(processes[1:])
