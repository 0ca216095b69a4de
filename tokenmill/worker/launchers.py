"""Where the executor's ranks 1..N-1 run: `--distributed-executor-backend mp` (fresh
interpreters on this machine, `worker_process.py`) or `ray` (Ray actors, `ray_workers.py`).

Both give the executor the same worker handle (`pid`, `is_alive()`, `join()`, `kill()`,
`describe_exit()`, and `on_exit` told on a watcher thread when it ends), so one executor
drives either: the step broadcast, the collectives, failure and shutdown are the same code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.worker.worker_process import WorkerProcess


class Worker(Protocol):
    @property
    def pid(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...

    def describe_exit(self) -> str: ...


class Launcher(Protocol):
    # The address this machine's ranks are reached at (None: MASTER_ADDR or loopback).
    host: str | None

    def start(self, rank: int, args: tuple[Any, ...], on_exit: Callable[[Any], None]) -> Worker: ...


class ProcessLauncher:
    """The mp backend: each rank a fresh interpreter of this machine."""

    host: str | None = None

    def start(
        self, rank: int, args: tuple[Any, ...], on_exit: Callable[[Any], None]
    ) -> WorkerProcess:
        return WorkerProcess(f"tokenmill-tp-{rank}", args, on_exit)


def worker_launcher(config: EngineConfig, world_size: int) -> Launcher:
    """The launcher of `config.distributed_executor_backend` for `world_size` ranks (rank 0
    is the engine's own process; the launcher starts the others)."""
    if config.distributed_executor_backend == "mp":
        return ProcessLauncher()
    try:
        from tokenmill.worker.ray_workers import RayLauncher
    except ImportError as e:  # ray is an optional extra
        raise ConfigError(
            f"distributed_executor_backend 'ray' needs Ray ({e}): pip install 'tokenmill[ray]'"
        ) from e
    return RayLauncher(config, world_size)
