"""Reading a router's replicas: their processes (from /proc) and its own metrics."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
from server_utils import Server, free_port, scrape, wait_healthy

NUM_REPLICAS = 2  # behind the session's `serve --data-parallel-size`
PREFIX_CHARS = 64  # its --prefix-chars: prompts must fit the tiny model's 256-token context
HEALTHY = "tokenmill:router_replica_healthy"
REQUESTS = "tokenmill:router_requests_total"


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started, from any of its threads (Linux /proc)."""
    pids = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(FileNotFoundError):  # a thread that has ended
            pids += [int(p) for p in children.read_text().split()]
    return sorted(pids)


def is_alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its parent, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float = 30) -> list[int]:
    """The pids still alive after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if is_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def replica_urls(http: httpx.Client) -> list[str]:
    return sorted(_label(k) for k in scrape(http) if k.startswith(HEALTHY))


def routed_counts(http: httpx.Client) -> dict[tuple[str, str], float]:
    """{(replica, decision): requests} from the router's metrics."""
    counts = {}
    for key, value in scrape(http).items():
        if key.startswith(REQUESTS + "{"):
            labels = dict(part.split("=", 1) for part in key[len(REQUESTS) + 1 : -1].split("}{"))
            counts[labels["replica"].strip('"'), labels["decision"].strip('"')] = value
    return counts


def start_router(backends: list[str], log_path: Path, *extra: str) -> Server:
    """`tokenmill router` in front of `backends`, healthy."""
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "router", "--port", str(port)]
    for url in backends:
        command += ["--backend", url]
    log = log_path.open("wb")
    process = subprocess.Popen([*command, *extra], stdout=log, stderr=subprocess.STDOUT)
    return wait_healthy(Server(f"http://127.0.0.1:{port}", process, log_path), 120)


def _label(key: str) -> str:
    return key.split('replica="', 1)[1].split('"', 1)[0]
