"""`--distributed-executor-backend ray`: ranks 1..N-1 as Ray actors, one placement-group
bundle per rank, driven by the same executor as the mp backend (`launchers.py`).

The engine joins the Ray cluster this machine belongs to (`RAY_ADDRESS`, or the one `ray
start` left here), else starts a local one. A placement group reserves one bundle of one CPU
per rank, packed on as few nodes as will hold them (vLLM's default), the bundle of rank 0 on
this node, where the engine runs it. Each actor runs the rank's whole life
(`tp_worker.serve_rank`) in one call: it loads its shard, meets the others at rank 0's TCP
store on this node's address (MASTER_ADDR overrides it), and runs every step rank 0
broadcasts. A watcher thread waits on that call: it ends at STOP, or fails when the actor dies
(killed, its node lost) or its rank raises, and the executor is told at once, as it is when a
worker process exits. Ray ends an actor with its owner, so none outlives its engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.worker.ray_cluster import connect, first_line, reserve
from tokenmill.worker.tp_worker import serve_rank

logger = logging.getLogger(__name__)

_CPUS_PER_RANK = 1.0
# How long an actor may take to start and say where it runs.
_START_TIMEOUT_S = 300.0


@ray.remote
class RankActor:
    """One rank: where it runs, then its whole life in one call."""

    def where(self) -> tuple[int, str]:
        return os.getpid(), ray.util.get_node_ip_address()

    def run(self, args: tuple[Any, ...]) -> None:
        # `run_worker`'s arguments end with the engine's pid, which a process of ours watches;
        # an actor's owner is Ray's to watch.
        serve_rank(*args[:-1])


class RayLauncher:
    """The placement group of one executor and the actors started in its bundles; the group
    is removed once every actor has ended."""

    def __init__(self, config: EngineConfig, world_size: int) -> None:
        if config.torch_device().type != "cpu":
            raise ConfigError(
                "distributed_executor_backend 'ray' runs CPU ranks only (not built for CUDA "
                "yet): use 'mp' there"
            )
        connect()
        self.host: str | None = ray.util.get_node_ip_address()
        bundles: list[dict[str, float]] = [{"CPU": _CPUS_PER_RANK} for _ in range(world_size)]
        bundles[0][f"node:{self.host}"] = 0.001  # rank 0 is the engine: its bundle is here
        what = f"{world_size} ranks of {_CPUS_PER_RANK:g} CPU"
        self.group: PlacementGroup = reserve(bundles, "PACK", what)
        self._running = world_size - 1
        self._lock = threading.Lock()

    def start(self, rank: int, args: tuple[Any, ...], on_exit: Callable[[Any], None]) -> RayWorker:
        return RayWorker(self, rank, args, on_exit)

    def worker_ended(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                remove_placement_group(self.group)


class RayWorker:
    """One rank's actor, with the worker handle `launchers.Worker` names."""

    def __init__(
        self,
        launcher: RayLauncher,
        rank: int,
        args: tuple[Any, ...],
        on_exit: Callable[[RayWorker], None],
    ) -> None:
        self.name = f"tokenmill-tp-{rank}"
        self._launcher = launcher
        strategy = PlacementGroupSchedulingStrategy(launcher.group, rank)
        # As a worker process gets it: the engine's own import path.
        path = os.pathsep.join(p for p in sys.path if p)
        self._actor = RankActor.options(  # type: ignore[attr-defined]
            num_cpus=_CPUS_PER_RANK,
            scheduling_strategy=strategy,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        ).remote()
        self._where = self._actor.where.remote()
        self._run = self._actor.run.remote(args)
        self._place: tuple[int, str] | None = None
        self._ending = "is still running"
        self._exited = threading.Event()
        self._on_exit = on_exit
        threading.Thread(target=self._watch, name=f"{self.name}-watch", daemon=True).start()

    def _watch(self) -> None:
        try:
            ray.get(self._run)
            self._ending = "stopped"
        except ray.exceptions.RayActorError as e:
            self._ending = f"died: {first_line(e)}"
        except ray.exceptions.RayTaskError as e:
            self._ending = f"failed: {first_line(e.cause or e)}"
        except Exception as e:  # the cluster itself is gone
            self._ending = f"was lost: {first_line(e)}"
        self._exited.set()
        self._on_exit(self)  # first: the engine learns of a death at once
        with contextlib.suppress(Exception):  # Ray shut down already (interpreter exit)
            ray.kill(self._actor, no_restart=True)  # its rank has ended, asked or not
            self._launcher.worker_ended()

    @property
    def pid(self) -> int | None:
        """The actor's process id (on its node), once it has started; None if it never did."""
        if self._place is None:
            try:
                self._place = ray.get(self._where, timeout=_START_TIMEOUT_S)
            except Exception:
                return None
        return self._place[0]

    def describe_exit(self) -> str:
        pid = self.pid
        node = f" on {self._place[1]}" if self._place is not None else ""
        return f"(Ray actor {self.name}, pid {pid}{node}) {self._ending}"

    def is_alive(self) -> bool:
        return not self._exited.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._exited.wait(timeout)

    def kill(self) -> None:
        if self.is_alive():
            with contextlib.suppress(Exception):  # Ray shut down already (interpreter exit)
                ray.kill(self._actor, no_restart=True)
