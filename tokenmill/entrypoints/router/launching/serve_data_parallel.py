"""`tokenmill serve --data-parallel-size N`: N `tokenmill serve` processes, each on a private
loopback port, behind the router on the command's own port.

The replicas (`supervisor.py`) are restarted when they die. On SIGTERM or SIGINT the router
forwards SIGTERM to every replica first, and keeps relaying while they drain (each finishes
what it can in `--shutdown-timeout` seconds and ends the rest with an error event, as one
`tokenmill serve` does); the router stops once their streams have ended.

With `--data-parallel-backend ray` the replicas are held by Ray actors on the nodes of a Ray
cluster (`ray_replicas.py`) instead of being processes of this machine: same supervisor, same
router, the replicas' addresses their nodes'.
"""

from __future__ import annotations

import argparse
import logging
import socket
import time

import httpx

from tokenmill.bench.server_process import free_port
from tokenmill.entrypoints.router.launching.router_server import run_router
from tokenmill.entrypoints.router.launching.supervisor import (
    Replica,
    ReplicaSupervisor,
    describe_exit,
)

logger = logging.getLogger("tokenmill.router")

STARTUP_TIMEOUT_SECONDS = 900.0
# Past the replicas' grace period: their error flush (ERROR_FLUSH_SECONDS in
# http/server.py) and the last bytes relayed. The router cuts only what is left after it.
DRAIN_MARGIN_SECONDS = 10.0


def run_data_parallel(args: argparse.Namespace, listener: socket.socket, argv: list[str]) -> int:
    if getattr(args, "data_parallel_backend", "mp") == "ray":
        return _run_on_ray(args, listener, argv)
    ports = [free_port() for _ in range(args.data_parallel_size)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    supervisor = ReplicaSupervisor(argv, ports)
    logger.info(
        "started %d replicas (pids %s) on %s",
        len(ports),
        ", ".join(str(c.pid) for c in supervisor.children),
        ", ".join(urls),
    )
    return route_to_supervised(args, listener, supervisor, urls, urls)


def _run_on_ray(args: argparse.Namespace, listener: socket.socket, argv: list[str]) -> int:
    try:
        from tokenmill.entrypoints.router.launching.ray_replicas import RayReplicas, replica_cpus
    except ImportError as e:  # ray is an optional extra
        needs = f"--data-parallel-backend ray needs Ray ({e}): pip install 'tokenmill[ray]'"
        raise OSError(needs) from e
    replicas = RayReplicas(argv, args.data_parallel_size, replica_cpus(args))
    try:
        ports = [port for _, port in replicas.places]
        supervisor = ReplicaSupervisor(argv, ports, starter=replicas.start)
        logger.info(
            "started %d replicas as Ray actors (pids %s on their nodes) at %s",
            len(ports),
            ", ".join(str(c.pid) for c in supervisor.children),
            ", ".join(replicas.urls),
        )
        return route_to_supervised(args, listener, supervisor, replicas.urls, replicas.urls)
    finally:
        replicas.close()


def route_to_supervised(
    args: argparse.Namespace,
    listener: socket.socket,
    supervisor: ReplicaSupervisor,
    urls: list[str],
    backends: list[str],
) -> int:
    """Once the replicas at `urls` answer, route to `backends` (or to `args.prefill` and
    `args.decode`) until SIGTERM/SIGINT, which drains the replicas; then stop them."""
    grace = args.shutdown_timeout + DRAIN_MARGIN_SECONDS
    try:
        wait_until_healthy(supervisor.children, urls)
        supervisor.watch()
        run_router(
            args,
            listener,
            backends,
            args.routing_policy,
            on_exit=supervisor.drain,
            graceful_timeout=grace,
        )
    finally:
        supervisor.stop(grace)
    return 0


def wait_until_healthy(children: list[Replica], urls: list[str]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
    pending = dict(zip(urls, children))
    while pending:
        for url, child in list(pending.items()):
            if child.poll() is not None:
                raise OSError(f"replica {url} {describe_exit(child)} at start-up")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    del pending[url]
            except httpx.TransportError:
                pass
        if time.monotonic() > deadline:
            raise OSError(f"replicas {', '.join(pending)} did not become healthy in time")
        time.sleep(0.2)
