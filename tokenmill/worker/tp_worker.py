"""A tensor-parallel worker process (ranks 1..N-1): load this rank's shard, then run every
step rank 0 broadcasts, until told to stop or its engine process is gone.

Every rank runs the same `ModelRunner` over the same `SchedulerOutput`: the model's
collectives keep the ranks in lockstep, the logits are all-gathered, and each rank samples
the same tokens from the same seeded generators (as vLLM v1's workers do), so a worker keeps
its own copy of each request's tokens and needs nothing back from rank 0 but the next step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import torch

from tokenmill.config import EngineConfig
from tokenmill.models.loader import LoadSettings, load_model
from tokenmill.models.weight_bytes import weight_bytes
from tokenmill.worker.distributed import (
    Rendezvous,
    broadcast_object,
    join_group,
    leave_group,
    rank_device,
)
from tokenmill.worker.pipeline import PipelineStageRunner, RankPosition, join_stages
from tokenmill.worker.runner_spec import RunnerSpec

logger = logging.getLogger(__name__)

# Broadcast instead of a SchedulerOutput: the engine is shutting down.
STOP = "stop"
# How often a worker checks that its engine process is still there.
_PARENT_POLL_S = 0.5


def run_worker(
    config: EngineConfig,
    load_settings: LoadSettings,
    rendezvous: Rendezvous,
    rank: int,
    num_threads: int,
    parent: int,
) -> None:
    """The worker process's entry point (started by `TensorParallelExecutor`, worker_process.py)."""
    _exit_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle: it stops us
    serve_rank(config, load_settings, rendezvous, rank, num_threads)
    # Skip the interpreter's teardown: its garbage collection of torch.distributed's objects
    # took 5 s after the group was gone, and there is nothing left to flush but logs.
    logging.shutdown()
    os._exit(0)


def serve_rank(
    config: EngineConfig,
    load_settings: LoadSettings,
    rendezvous: Rendezvous,
    rank: int,
    num_threads: int,
) -> None:
    """Rank `rank`'s life, wherever it runs (a worker process, a Ray actor): load its shard,
    join the groups, run every step rank 0 broadcasts until STOP, leave."""
    torch.set_num_threads(num_threads)
    # Devices are numbered per machine: rank r is the (r mod ranks per machine)-th there.
    device = rank_device(config.torch_device(), rank % (rendezvous.world_size // config.nnodes))
    # Load first, as rank 0 does: once the ranks meet, every step is bounded by the timeout.
    torch.manual_seed(config.seed)
    position = RankPosition(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    tp = position.tensor_parallel()
    model = load_model(config.model, load_settings, device, tp, position.stage)
    _, step_group = join_group(rendezvous, rank)
    try:
        link = join_stages(position, tp, step_group)
        spec: RunnerSpec = broadcast_object(None, step_group)
        report_weight_bytes(model, step_group)
        runner = PipelineStageRunner(model, spec, device, link)
        while True:
            scheduler_output = broadcast_object(None, step_group)
            if scheduler_output == STOP:
                break
            runner.execute_model(scheduler_output)
    finally:
        leave_group()


def report_weight_bytes(model: torch.nn.Module, step_group: Any) -> list[int]:
    """Every rank's weight bytes (`weight_bytes`), in rank order (a collective: all ranks
    call it)."""
    sizes: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(sizes, weight_bytes(model), group=step_group)
    return sizes


def _exit_with_parent(parent: int) -> None:
    """Exit when the engine process is gone (killed, so it could not stop us): no orphans."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()
