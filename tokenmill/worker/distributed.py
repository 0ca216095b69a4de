"""The process groups of a tensor-parallel engine, shared by rank 0 (the engine) and workers.

Two groups, as vLLM keeps a device group and a CPU group:
- the default group carries the model's collectives (gloo on CPU, nccl on CUDA) with a short
  timeout (`EngineConfig.distributed_timeout`), so a hung peer fails the step in bounded time;
- the step group (always gloo) carries each step's pickled `SchedulerOutput` from rank 0 (whose
  send to a hung worker times out like a collective). A worker waits there between steps for as
  long as the engine is idle, so its own timeout is long; a worker whose engine process has
  gone notices by its parent's pid (`tp_worker.py`).

Rendezvous is torch.distributed's TCP store at MASTER_ADDR:MASTER_PORT (defaults: 127.0.0.1 and
a free port picked by rank 0). Ranks on other machines (`nnodes` > 1) meet there too: rank 0
leaves their arguments at the store, and `tokenmill tp-worker` fetches them
(`worker/remote_workers.py`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenmill.config import ConfigError
from tokenmill.layers.parallel import TensorParallel

# How long a worker waits for the next step: an idle server sends none for hours.
_STEP_WAIT = timedelta(days=365)
# How long ranks may take to start and meet (spawn, imports, loading on a busy machine).
_START_TIMEOUT = timedelta(minutes=5)
_JOINED = "tokenmill/joined"  # store counter: ranks that reached the rendezvous
_WORKER_ARGS = "tokenmill/worker_args"  # what the workers of other machines run with


@dataclass(frozen=True)
class Rendezvous:
    address: str  # host:port of the TCP store
    world_size: int
    timeout_s: float
    backend: str  # of the model's collectives

    @classmethod
    def local(
        cls,
        world_size: int,
        timeout_s: float,
        device: torch.device,
        across_machines: bool = False,
        host: str | None = None,
    ) -> Rendezvous:
        """From MASTER_ADDR and MASTER_PORT, which ranks on other machines must be told;
        without MASTER_ADDR, at `host` (this node's address for Ray's actors) or loopback."""
        if across_machines and not (
            os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")
        ):
            raise ConfigError(
                "nnodes > 1 needs MASTER_ADDR and MASTER_PORT: where the other machines' "
                "`tokenmill tp-worker` meet this one"
            )
        address = os.environ.get("MASTER_ADDR") or host or "127.0.0.1"
        port = int(os.environ.get("MASTER_PORT", "0")) or _free_port(address)
        backend = "nccl" if device.type == "cuda" else "gloo"
        return cls(f"{address}:{port}", world_size, timeout_s, backend)


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: cuda:r on a CUDA machine (one device per rank), else the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def join_group(
    rendezvous: Rendezvous,
    rank: int,
    check_peers: Callable[[], None] = lambda: None,
    worker_args: bytes | None = None,
) -> tuple[TensorParallel, Any]:
    """Join the default (model) group and the step group; (this rank's view, step group).

    Rank 0 waits for the others at the store, calling `check_peers` meanwhile, so a worker
    that died starting fails the start at once; it first leaves `worker_args` there for the
    workers of other machines (`fetch_worker_args`). Starting may take minutes (a loaded
    machine importing torch); the collectives' timeout is `rendezvous.timeout_s`.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process: one tensor-parallel "
            "engine per process"
        )
    store = _store(rendezvous, rank)
    if worker_args is not None:
        store.set(_WORKER_ARGS, worker_args)
    store.add(_JOINED, 1)
    deadline = time.monotonic() + _START_TIMEOUT.total_seconds()
    while rank == 0 and store.add(_JOINED, 0) < rendezvous.world_size:
        check_peers()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the tensor-parallel workers did not start in {_START_TIMEOUT}")
        time.sleep(0.05)
    dist.init_process_group(
        rendezvous.backend,
        store=store,
        rank=rank,
        world_size=rendezvous.world_size,
        timeout=timedelta(seconds=rendezvous.timeout_s),
    )
    # The timeout is each rank's own: rank 0's sends give up like any collective, a worker's
    # receive waits for the next step however long the engine idles.
    step_timeout = timedelta(seconds=rendezvous.timeout_s) if rank == 0 else _STEP_WAIT
    step_group = dist.new_group(backend="gloo", timeout=step_timeout)
    return TensorParallel(rank=rank, size=rendezvous.world_size), step_group


def _store(rendezvous: Rendezvous, rank: int) -> dist.TCPStore:
    host, port = rendezvous.address.rsplit(":", 1)
    return dist.TCPStore(
        host,
        int(port),
        rendezvous.world_size,
        is_master=rank == 0,
        timeout=_START_TIMEOUT,
        wait_for_workers=False,
    )


def fetch_worker_args(address: str, timeout_s: float = _START_TIMEOUT.total_seconds()) -> bytes:
    """On another machine: what rank 0 left at the store at `address` (host:port) for its
    workers, once it is there (rank 0 publishes it after loading its shard)."""
    host, port = address.rsplit(":", 1)
    limit = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=limit)
    return store.get(_WORKER_ARGS)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_object(obj: Any, group: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank of `group` (other ranks pass None)."""
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]
