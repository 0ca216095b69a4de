"""`tokenmill serve --data-parallel-size N`: N `tokenmill serve` processes, each on a private
loopback port, behind the router on the command's own port.

Each replica is the same command line with `--host 127.0.0.1 --port P --data-parallel-size 1`
appended (argparse keeps the last value of a flag). Replicas die with the command: they get
SIGTERM when it ends, are killed if they outlive the grace period, and are started with the
kernel's parent-death signal (PR_SET_PDEATHSIG), so that even a command killed with SIGKILL
leaves no orphan replicas.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import signal
import socket
import subprocess
import sys
import time

import httpx

from tokenmill.bench.server_process import free_port
from tokenmill.entrypoints.router.server import run_router

logger = logging.getLogger("tokenmill.router")

PR_SET_PDEATHSIG = 1
STARTUP_TIMEOUT_SECONDS = 900.0


def run_data_parallel(args: argparse.Namespace, listener: socket.socket, argv: list[str]) -> int:
    ports = [free_port() for _ in range(args.data_parallel_size)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    children = [_start_replica(argv, port) for port in ports]
    logger.info(
        "started %d replicas (pids %s) on %s",
        len(children),
        ", ".join(str(c.pid) for c in children),
        ", ".join(urls),
    )
    try:
        _wait_until_healthy(children, urls)
        run_router(args, listener, urls, args.routing_policy)
    finally:
        stop_replicas(children, args.shutdown_timeout + 5)
    return 0


def _start_replica(argv: list[str], port: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "tokenmill.entrypoints.cli", *argv,
        "--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", "1",
    ]  # fmt: skip
    return subprocess.Popen(command, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies; the default SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _wait_until_healthy(children: list[subprocess.Popen[bytes]], urls: list[str]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
    pending = dict(zip(urls, children))
    while pending:
        for url, child in list(pending.items()):
            if child.poll() is not None:
                raise OSError(f"replica {url} exited with status {child.returncode} at start-up")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    del pending[url]
            except httpx.TransportError:
                pass
        if time.monotonic() > deadline:
            raise OSError(f"replicas {', '.join(pending)} did not become healthy in time")
        time.sleep(0.2)


def stop_replicas(children: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """SIGTERM to each, then SIGKILL to any still alive after `timeout` seconds."""
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("replica pid %d ignored SIGTERM: killing it", child.pid)
            child.kill()
            child.wait()
