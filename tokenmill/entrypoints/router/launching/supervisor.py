"""The replica processes of `tokenmill serve --data-parallel-size N`: started, restarted when
one dies, drained and stopped with the command.

Each replica is the command's own line with `--host 127.0.0.1 --port P --data-parallel-size 1`
appended (argparse keeps the last value of a flag), started with the kernel's parent-death
signal (PR_SET_PDEATHSIG) so that even a command killed with SIGKILL leaves no orphans.

- A replica that exits while the command runs (killed, its engine died) is started again on
  its port after a backoff that doubles from 1 s to 30 s (back to 1 s once a replica has run
  for a minute), each restart logged; the router's health checks put it back in rotation.
- `drain()` (the command's SIGTERM/SIGINT) forwards SIGTERM to every replica at once, so each
  drains as `tokenmill serve` does while the router still relays their streams to the end;
  `stop()` then waits for them and kills any that outlive the grace period.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger("tokenmill.router")

PR_SET_PDEATHSIG = 1
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0
STABLE_SECONDS = 60.0  # a replica up this long has its backoff reset
POLL_SECONDS = 0.2

_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the forked child only calls it


@dataclass(frozen=True)
class ReplicaLaunch:
    """What one replica gets besides the command's own line: more flags (after it, so they
    win), the CPUs it is pinned to (None: all of the command's) and how much nicer than the
    command it runs (`os.nice`: a prefill instance yields its CPUs to the router's streaming
    and the decode instance's KV receiver when they need them)."""

    extra_args: tuple[str, ...] = ()
    cpus: frozenset[int] | None = None
    nice: int = 0


class Replica(Protocol):
    """What the supervisor asks of a replica: a `subprocess.Popen`'s few methods (the mp
    backend's replicas are Popen objects; `ray_replicas.RayReplica` answers them through a Ray
    actor). `wait` raises `subprocess.TimeoutExpired` when `timeout` passes."""

    pid: int | None
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, signum: int) -> None: ...

    def kill(self) -> None: ...


class ReplicaSupervisor:
    def __init__(
        self,
        argv: list[str],
        ports: list[int],
        launches: list[ReplicaLaunch] | None = None,
        starter: Callable[[int], Replica] | None = None,
    ) -> None:
        """`starter(index)` starts replica `index` (default: a process of this machine on
        `ports[index]`, `argv` with its `launches[index]`)."""
        self.argv = argv
        self.ports = ports
        self.launches = launches or [ReplicaLaunch()] * len(ports)
        self._starter = starter
        self.children: list[Replica] = [self._start(index) for index in range(len(ports))]
        self._started = [time.monotonic()] * len(ports)
        self._backoff = [FIRST_BACKOFF_SECONDS] * len(ports)
        self._restart_at: list[float | None] = [None] * len(ports)
        self._stopping = threading.Event()
        self._done = threading.Event()
        self._lock = threading.RLock()  # children; drain() also runs in a signal handler
        self._thread: threading.Thread | None = None

    def watch(self) -> None:
        """Restart replicas that die, on a thread of its own, until `stop()`. The thread lives
        until then: a replica's parent-death signal follows the thread that started it."""
        self._thread = threading.Thread(target=self._run, name="replica-supervisor", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """SIGTERM to every replica now (no more restarts); returns at once."""
        self._stopping.set()
        with self._lock:
            for child in self.children:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)

    def stop(self, timeout: float) -> None:
        """Drain, wait up to `timeout` seconds, SIGKILL whatever is left; end the watcher."""
        self.drain()
        deadline = time.monotonic() + timeout
        for child in self.children:
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("replica pid %d ignored SIGTERM: killing it", child.pid)
                child.kill()
                child.wait()
        self._done.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._done.wait(POLL_SECONDS):
            if not self._stopping.is_set():
                for index in range(len(self.children)):
                    self._check(index)

    def _check(self, index: int) -> None:
        child, port, now = self.children[index], self.ports[index], time.monotonic()
        if child.poll() is None:
            if now - self._started[index] > STABLE_SECONDS:
                self._backoff[index] = FIRST_BACKOFF_SECONDS
            return
        restart_at = self._restart_at[index]
        if restart_at is None:
            delay = self._backoff[index]
            self._restart_at[index] = now + delay
            self._backoff[index] = min(2 * delay, MAX_BACKOFF_SECONDS)
            logger.warning(
                "replica on port %d (pid %s) %s; restarting it in %.0f s",
                port, child.pid, describe_exit(child), delay,
            )  # fmt: skip
        elif now >= restart_at:
            with self._lock:
                if self._stopping.is_set():
                    return
                self.children[index] = replacement = self._start(index)
            self._started[index], self._restart_at[index] = now, None
            if replacement.poll() is None:  # else the next check reports why, and retries
                logger.warning("restarted the replica on port %d (pid %s)", port, replacement.pid)

    def _start(self, index: int) -> Replica:
        if self._starter is not None:
            return self._starter(index)
        return _start_replica(self.argv, self.ports[index], self.launches[index])


def describe_exit(child: Replica) -> str:
    """How a replica ended: its exit status, or what its host says (a Ray actor lost)."""
    return getattr(child, "ending", "") or f"exited with status {child.returncode}"


def _start_replica(argv: list[str], port: int, launch: ReplicaLaunch) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "tokenmill.entrypoints.cli", *argv,
        "--host", "127.0.0.1", "--port", str(port), "--data-parallel-size", "1",
        *launch.extra_args,
    ]  # fmt: skip
    env = None
    if launch.cpus is not None:  # as many OpenMP threads as its CPUs, not the machine's
        env = {**os.environ, "OMP_NUM_THREADS": str(len(launch.cpus))}
    return subprocess.Popen(
        command,
        env=env,
        preexec_fn=functools.partial(_die_with_parent, launch.cpus, launch.nice),
    )


def _die_with_parent(cpus: frozenset[int] | None = None, nice: int = 0) -> None:
    """In the child, before exec: SIGTERM when the parent dies; the default SIGINT; pinned
    to `cpus` if given and `nice` more (both inherited by everything it starts)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    if nice:
        os.nice(nice)
