"""Starting and stopping a real `tokenmill serve` process, and reading its /metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "sk-tokenmill-test"
MODEL = "tiny-llama"
MAX_MODEL_LEN = 256


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CLI = ("-m", "tokenmill.entrypoints.cli")


def start_server(
    model_dir: Path | None,
    log_path: Path,
    *extra_args: str,
    launcher: tuple[str, ...] = CLI,
    timeout: float = 120,
) -> Server:
    """Start `tokenmill serve` and wait until /health answers 200. With no `model_dir`, the
    server runs as a newcomer starts it: default model, default name. `launcher`: what
    Python runs instead of the CLI module (a script that injects a fault, then calls it);
    `timeout`: seconds to wait (several replicas start slower)."""
    port = free_port()
    model_args = [] if model_dir is None else [str(model_dir), "--served-model-name", MODEL]
    command = [
        sys.executable, *launcher, "serve", *model_args,
        "--port", str(port), "--api-key", API_KEY,
        "--max-model-len", str(MAX_MODEL_LEN), "--disable-uvicorn-access-log",
        *extra_args,
    ]  # fmt: skip
    log = log_path.open("wb")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_default_sigint
    )
    return wait_healthy(Server(f"http://127.0.0.1:{port}", process, log_path), timeout)


def wait_healthy(server: Server, timeout: float) -> Server:
    """Wait until `server`'s /health answers 200; stop it and raise if it exits or never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"server did not become healthy:\n{server.log}")


def _default_sigint() -> None:
    """Ctrl+C's SIGINT acts on the server as from a terminal, even when pytest was started in
    the background (whose children inherit SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_server(server: Server, timeout: float = 30) -> int:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(timeout)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()
    return server.process.returncode


def scrape(http: httpx.Client) -> dict[str, float]:
    """`/metrics` as {'name{label="value",...}': value}, labels sorted, model_name dropped."""
    response = http.get("/metrics")
    response.raise_for_status()
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            key = sample.name + "".join(f'{{{k}="{v}"}}' for k, v in sorted(labels.items()))
            values[key] = sample.value
    return values


IDLE = {
    "tokenmill:num_requests_running": 0,
    "tokenmill:num_requests_waiting": 0,
    "tokenmill:kv_cache_usage_perc": 0,
}


def wait_for(
    http: httpx.Client, expected: dict[str, float], timeout: float = 60.0
) -> dict[str, float]:
    """Poll /metrics until every metric in `expected` has its value (or the timeout, a hang
    guard for a loaded machine, passes); the last scrape. Requests finish asynchronously to
    what a client sees, e.g. an abort."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = scrape(http)
        if all(metrics.get(k) == v for k, v in expected.items()) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def wait_until_idle(http: httpx.Client, timeout: float = 60.0) -> dict[str, float]:
    """Poll /metrics until nothing runs, waits or holds KV blocks."""
    return wait_for(http, IDLE, timeout)
