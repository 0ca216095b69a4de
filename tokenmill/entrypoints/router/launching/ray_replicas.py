"""`serve --data-parallel-size N --data-parallel-backend ray`: each replica a `tokenmill serve`
process held by a Ray actor on the node Ray places it on, behind the command's router.

A placement group reserves one bundle per replica (the CPUs of its ranks: tensor x pipeline
parallel size), spread over the nodes where it can be (vLLM spreads its data-parallel ranks).
The actor in each bundle picks a free port on its node and starts the replica there, bound
to the node's address, with the parent-death signal: a replica never outlives its actor, and
Ray ends the actors with their owner, this command.

`RayReplica` is the supervisor's replica handle for such a process, Popen's few methods
(`poll`, `wait`, `send_signal`, `kill`, `pid`, `returncode`) answered through the actor, so
`supervisor.py` restarts, drains and stops Ray replicas as it does processes: a replica that
exits is restarted on its port by the same actor; an actor that dies (killed, its node lost)
is reported and replaced by a new actor in its bundle, which must come up at the replica's
address (the router knows replicas by URL): else the attempt is reported as failed and
retried with the supervisor's backoff.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenmill.entrypoints.router.launching.supervisor import _die_with_parent
from tokenmill.worker.ray_cluster import PLACEMENT_TIMEOUT_S, connect, first_line, reserve

logger = logging.getLogger("tokenmill.router")

# How long one call to an actor may take before its replica counts as unreachable this time.
_CALL_TIMEOUT_S = 30.0
_POLL_S = 0.2


@ray.remote
class ReplicaHost:
    """Holds one replica process on its node (one method call at a time, on the actor's
    main thread: the parent-death signal follows the thread that started the process)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None

    def place(self, port: int | None) -> tuple[str, int]:
        """This node's address and `port` if it is free here (else an error), or a free one."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((host, port or 0))
            return host, probe.getsockname()[1]

    def start(self, argv: list[str], host: str, port: int) -> int:
        command = [
            sys.executable, "-m", "tokenmill.entrypoints.cli", *argv,
            "--host", host, "--port", str(port), "--data-parallel-size", "1",
        ]  # fmt: skip
        self.process = subprocess.Popen(command, preexec_fn=_die_with_parent)
        return self.process.pid

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)


class RayReplica:
    """One replica process through its actor, with the Popen methods the supervisor uses."""

    def __init__(self, host: ray.actor.ActorHandle, pid: int | None, ending: str = "") -> None:
        self.host = host
        self.pid = pid
        self.returncode: int | None = None if pid is not None else -1
        self.ending = ending  # why it is gone, when its actor is (else its exit status says)

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            self.returncode = ray.get(self.host.poll.remote(), timeout=_CALL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            return None  # a slow node is not a dead one
        except Exception as e:  # the actor died (killed, its node lost), or Ray is gone
            self.returncode, self.ending = -1, f"was lost with its Ray actor: {first_line(e)}"
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"Ray replica pid {self.pid}", timeout or 0.0)
            time.sleep(_POLL_S)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """Asked, not awaited: `drain()` runs in a signal handler."""
        with contextlib.suppress(Exception):
            self.host.signal.remote(signum)

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            ray.get(self.host.signal.remote(signal.SIGKILL), timeout=_CALL_TIMEOUT_S)
        self.returncode = self.returncode if self.returncode is not None else -signal.SIGKILL


class RayReplicas:
    """The placement group, an actor per bundle, and the address each replica is served at."""

    def __init__(self, argv: list[str], count: int, cpus: float) -> None:
        connect()
        self.argv = argv
        self.cpus = cpus
        what = f"{count} replicas of {cpus:g} CPUs"
        self.group: PlacementGroup = reserve([{"CPU": cpus}] * count, "SPREAD", what)
        self.hosts = [self._new_host(index) for index in range(count)]
        self.places = ray.get([host.place.remote(None) for host in self.hosts])
        self.urls = [f"http://{_url_host(host)}:{port}" for host, port in self.places]

    def start(self, index: int) -> RayReplica:
        """The replica of bundle `index`, started at its address: by its actor, or by a new
        actor in the bundle when the old one is gone."""
        host, port = self.places[index]
        actor = self.hosts[index]
        try:
            pid = ray.get(actor.start.remote(self.argv, host, port), timeout=_CALL_TIMEOUT_S)
            return RayReplica(actor, pid)
        except Exception as e:
            logger.warning(
                "replica %d's Ray actor is gone (%s): starting a new one", index, first_line(e)
            )
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        self.hosts[index] = actor = self._new_host(index)
        try:
            where = ray.get(actor.place.remote(port), timeout=PLACEMENT_TIMEOUT_S)
            if where[0] != host:
                raise OSError(f"its new actor runs on {where[0]}, not {host}")
            pid = ray.get(actor.start.remote(self.argv, host, port), timeout=_CALL_TIMEOUT_S)
        except Exception as e:
            reason = f"could not be started again at {host}:{port}: {first_line(e)}"
            return RayReplica(actor, None, reason)
        return RayReplica(actor, pid)

    def close(self) -> None:
        """End the actors (and with them any replica left) and free the bundles."""
        for actor in self.hosts:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(self.group)

    def _new_host(self, index: int) -> ray.actor.ActorHandle:
        path = os.pathsep.join(p for p in sys.path if p)  # the command's own import path
        return ReplicaHost.options(  # type: ignore[attr-defined]
            num_cpus=self.cpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, index),
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        ).remote()


def replica_cpus(args: argparse.Namespace) -> float:
    """A replica's bundle: one CPU per rank of its engine."""
    return float(args.tensor_parallel_size * args.pipeline_parallel_size)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
