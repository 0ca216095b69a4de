"""SIGTERM: stop accepting, let in-flight requests finish within the grace period, end the rest
with an error."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from server_utils import API_KEY, MODEL, scrape, start_server, stop_server

GRACE_SECONDS = 5
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def stream_tokens(url: str, body: dict[str, Any], seen: list[str], first: threading.Event) -> None:
    """Collect a stream's events until the server ends or cuts it."""
    try:
        with httpx.stream("POST", url, json=body, headers=HEADERS, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    seen.append(line.removeprefix("data: "))
                    first.set()
    except httpx.HTTPError:
        pass  # cut off by the shutdown
    finally:
        first.set()


def test_sigterm_drains_in_flight_requests_then_exits(model_dir: Path, tmp_path: Path) -> None:
    server = start_server(
        model_dir,
        tmp_path / "server.log",
        "--max-model-len", "2048", "--shutdown-timeout", str(GRACE_SECONDS),
    )  # fmt: skip
    try:
        url = f"{server.url}/v1/completions"
        long_body = {
            "model": MODEL, "prompt": "Long", "max_tokens": 2000, "n": 128, "ignore_eos": True,
            "stream": True,
        }  # fmt: skip
        long_events: list[str] = []
        started = threading.Event()
        long_request = threading.Thread(
            target=stream_tokens, args=(url, long_body, long_events, started)
        )
        long_request.start()
        assert started.wait(30)

        short_result: dict[str, Any] = {}
        short_body = {"model": MODEL, "prompt": "Short", "max_tokens": 20, "ignore_eos": True}

        def short() -> None:
            response = httpx.post(url, json=short_body, headers=HEADERS, timeout=60)
            short_result.update(status=response.status_code, body=response.json())

        short_request = threading.Thread(target=short)
        short_request.start()
        _wait_for_running(server.url, 128 + 1)  # both requests are in the engine
        signal_time = time.monotonic()
        server.process.send_signal(signal.SIGTERM)

        assert _refuses_connections(server.url), "still accepting after SIGTERM"
        short_request.join(30)
        assert short_result["status"] == 200
        assert short_result["body"]["usage"]["completion_tokens"] == 20

        long_request.join(30)
        server.process.wait(30)
        # uvicorn re-raises the signal once it has shut down cleanly, so a supervisor sees
        # "ended by SIGTERM" (the log line below shows the shutdown ran to completion).
        assert server.process.returncode in (0, -signal.SIGTERM)
        assert time.monotonic() - signal_time < GRACE_SECONDS + 10
        # Cut at the end of the grace period, but cleanly: an error event, then [DONE].
        assert long_events, "the long stream never started"
        assert long_events[-1] == "[DONE]"
        error = json.loads(long_events[-2])["error"]
        assert error["type"] == "server_error" and "shutting down" in error["message"]
        received = sum(len(json.loads(e)["choices"]) for e in long_events[:-2])
        assert received < 128 * 2000
        assert "Application shutdown complete" in server.log
    finally:
        stop_server(server)


# `tokenmill serve` with an engine whose step kills the loop (not an Exception: the loop's
# per-step error handling does not catch it).
DYING_ENGINE = """
import sys
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.cli import main

class Fatal(BaseException):
    pass

def step(self):
    raise Fatal("injected: the engine loop dies")

LLMEngine.step = step
sys.exit(main(sys.argv[1:]))
"""


def test_a_dead_engine_loop_ends_the_process_with_an_error(model_dir: Path, tmp_path: Path) -> None:
    """Rather than answer 503 forever, exit non-zero so that a supervisor restarts it."""
    server = start_server(model_dir, tmp_path / "server.log", launcher=("-c", DYING_ENGINE))
    try:
        url = f"{server.url}/v1/completions"
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True}
        with httpx.stream("POST", url, json=body, headers=HEADERS, timeout=60) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_dead"
        assert server.process.wait(30) == 1
        assert "the engine loop died" in server.log and "supervisor" in server.log
    finally:
        stop_server(server)


def test_a_dead_tensor_parallel_worker_ends_the_server_at_once(
    model_dir: Path, tmp_path: Path
) -> None:
    """kill -9 of rank 1: open requests end now with an error naming the worker, /health
    fails, and the process exits with status 1 (it used to answer 200 and fail every request
    forever)."""
    server = start_server(
        model_dir, tmp_path / "server.log", "--tensor-parallel-size", "2", "--dtype", "float32",
        timeout=300,
    )  # fmt: skip
    try:
        url = f"{server.url}/v1/completions"
        stream_body = {
            "model": MODEL, "prompt": "Long", "max_tokens": 200, "ignore_eos": True,
            "stream": True,
        }  # fmt: skip
        events: list[str] = []
        started = threading.Event()
        streamer = threading.Thread(target=stream_tokens, args=(url, stream_body, events, started))
        streamer.start()
        assert started.wait(60)
        plain: dict[str, Any] = {}

        def plain_request() -> None:
            body = {"model": MODEL, "prompt": "Plain", "max_tokens": 200, "ignore_eos": True}
            response = httpx.post(url, json=body, headers=HEADERS, timeout=120)
            plain.update(status=response.status_code, body=response.json())

        requester = threading.Thread(target=plain_request)
        requester.start()
        _wait_for_running(server.url, 2)
        (worker,) = _tensor_parallel_workers(server.process.pid)
        os.kill(worker, signal.SIGKILL)

        requester.join(60)
        streamer.join(60)
        assert plain["status"] == 503
        assert plain["body"]["error"]["code"] == "engine_dead"
        assert "tensor-parallel worker rank 1" in plain["body"]["error"]["message"]
        assert events[-1] == "[DONE]"
        assert "tensor-parallel worker rank 1" in json.loads(events[-2])["error"]["message"]
        with contextlib.suppress(httpx.TransportError):  # or already gone
            assert httpx.get(f"{server.url}/health", timeout=5).status_code != 200
        assert server.process.wait(60) == 1
        assert "exited with code -9" in server.log
    finally:
        stop_server(server)


def _tensor_parallel_workers(pid: int) -> list[int]:
    """The tensor-parallel worker processes `pid` started (Linux /proc)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [
        int(child)
        for child in children
        if b"tokenmill.worker" in Path(f"/proc/{child}/cmdline").read_bytes()
    ]


def test_ctrl_c_shuts_down_cleanly_without_a_traceback(model_dir: Path, tmp_path: Path) -> None:
    server = start_server(model_dir, tmp_path / "server.log", "--shutdown-timeout", "2")
    try:
        server.process.send_signal(signal.SIGINT)
        server.process.wait(30)
        assert "Application shutdown complete" in server.log
        assert "Traceback" not in server.log and "KeyboardInterrupt" not in server.log
        assert server.process.returncode == 128 + signal.SIGINT  # as a shell reports Ctrl+C
    finally:
        stop_server(server)


def _wait_for_running(url: str, num_running: int) -> None:
    deadline = time.monotonic() + 30
    with httpx.Client(base_url=url) as client:
        while scrape(client)["tokenmill:num_requests_running"] < num_running:
            assert time.monotonic() < deadline, f"never saw {num_running} requests running"
            time.sleep(0.01)


def _refuses_connections(url: str, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False
