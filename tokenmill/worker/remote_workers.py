"""`tokenmill tp-worker`: the tensor-parallel ranks of one more machine, for an engine whose rank
0 runs on another (`--tensor-parallel-size N --nnodes M` there).

Rank 0 leaves the workers' arguments (its config, how models load, the rendezvous, threads per
rank) at its TCP store once its own shard is loaded; this command fetches them from
MASTER_ADDR:MASTER_PORT, starts machine K's ranks (`K * N/M` to `(K+1) * N/M - 1`) as fresh
interpreters, as rank 0 starts its own (`worker_process.py`), and waits for them. They stop
with the engine (its stop broadcast, or its connections closing when it dies); if one dies the
others are stopped, and the command exits with its code. The model must be at the same path on
every machine.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading

from tokenmill.config import EngineConfig
from tokenmill.models.loader import LoadSettings
from tokenmill.worker.distributed import Rendezvous, fetch_worker_args
from tokenmill.worker.worker_process import WorkerProcess

logger = logging.getLogger(__name__)


def run_remote_workers(address: str, node_rank: int) -> int:
    """Start machine `node_rank`'s ranks of the engine whose store is at `address`
    (host:port); their exit status once all have exited."""
    config, load_settings, rendezvous, num_threads = _worker_args(address)
    per_node = rendezvous.world_size // config.nnodes
    if not 1 <= node_rank < config.nnodes:
        raise ValueError(f"--node-rank must be in [1, {config.nnodes}) for this engine")
    ranks = range(node_rank * per_node, (node_rank + 1) * per_node)
    exited = threading.Event()
    workers = [
        WorkerProcess(
            f"tokenmill-tp-{rank}",
            (config, load_settings, rendezvous, rank, num_threads, os.getpid()),
            lambda _: exited.set(),
        )
        for rank in ranks
    ]
    logger.info(
        "tensor-parallel ranks %s of %d started (pids %s) for the engine at %s",
        list(ranks), rendezvous.world_size, [w.pid for w in workers], address,
    )  # fmt: skip
    while any(w.is_alive() for w in workers):
        exited.wait()
        exited.clear()
        failed = [w for w in workers if not w.is_alive() and w.exitcode]
        for worker in workers if failed else []:
            worker.kill()  # one rank is gone: the engine cannot use the others
    codes = [w.exitcode or 0 for w in workers]
    return next((code for code in codes if code), 0)


def _worker_args(address: str) -> tuple[EngineConfig, LoadSettings, Rendezvous, int]:
    config, load_settings, rendezvous, num_threads = pickle.loads(fetch_worker_args(address))
    assert isinstance(config, EngineConfig) and isinstance(rendezvous, Rendezvous)
    assert isinstance(load_settings, LoadSettings)
    return config, load_settings, rendezvous, num_threads
