"""Rank 0's side of tensor parallelism: start the workers, hand them each step, watch them.

The engine process is rank 0 (as in vLLM's multiproc executor with its driver worker): the
scheduler, the sampler's results and the outputs are already there, so a step costs one
broadcast of the `SchedulerOutput` and nothing comes back but the collectives inside the
forward. Ranks 1..N-1 are fresh interpreters (`worker_process.py`, `tp_worker.py`): nothing of
the caller's script runs in them, so a plain script needs no `if __name__ == "__main__":`.

Failure: a watcher thread per worker sees it exit at once, even while the engine idles (as
vLLM's executor watches its workers' sentinels): the executor is marked failed, the other
workers are killed (so a collective waiting on them fails now) and `on_failure` is told (the
async engine dies then, and the server exits). A worker that hangs mid-step fails rank 0's
next collective by `distributed_timeout`. Either way every later step raises
`TensorParallelError` naming the worker. Shutdown (explicit, garbage collection or
interpreter exit) stops the workers too; a worker whose engine was killed exits on its own.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from tokenmill.config import EngineConfig
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.loader import LoadSettings
from tokenmill.step.runner_output import ModelRunnerOutput
from tokenmill.step.scheduler_output import SchedulerOutput
from tokenmill.worker.distributed import Rendezvous, broadcast_object, join_group, leave_group
from tokenmill.worker.launchers import Worker, worker_launcher
from tokenmill.worker.pipeline import PipelineStageRunner, RankPosition, StageLink, join_stages
from tokenmill.worker.runner_spec import RunnerSpec
from tokenmill.worker.tp_worker import STOP, report_weight_bytes

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0
# How long a failed collective waits to see whether a worker has exited.
_EXIT_REPORT_S = 1.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died or stopped answering; the engine cannot continue."""


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, load_settings: LoadSettings) -> None:
        """`load_settings`: how every rank loads its shard (`models/loader.py`)."""
        # Pipeline parallelism multiplies the ranks: rank 0 is the first stage's first.
        self.position = RankPosition(0, config.tensor_parallel_size, config.pipeline_parallel_size)
        size = self.position.world_size
        device = config.torch_device()
        launcher = worker_launcher(config, size)  # mp: processes; ray: actors (launchers.py)
        self.rendezvous = Rendezvous.local(
            size,
            config.distributed_timeout,
            device,
            across_machines=config.nnodes > 1,
            host=launcher.host,
        )
        self._engine_threads = torch.get_num_threads()  # restored at shutdown
        num_threads = max(1, self._engine_threads // size) if device.type == "cpu" else 1
        torch.set_num_threads(num_threads)
        self.failure: TensorParallelError | None = None
        self._stopping = threading.Event()  # set before the workers are told to exit
        self._lock = threading.Lock()  # failure is set by the engine or a watcher thread
        # Told (on a watcher thread) when a worker dies unasked: the engine cannot go on.
        self.on_failure: Callable[[TensorParallelError], None] | None = None
        self.workers: list[Worker] = []  # this machine's (mp) or the cluster's (ray)
        for rank in range(1, size // config.nnodes):
            args = (config, load_settings, self.rendezvous, rank, num_threads, os.getpid())
            on_exit = _weak_callback(weakref.WeakMethod(self._worker_exited), rank)
            self.workers.append(launcher.start(rank, args, on_exit))
        # What `tokenmill tp-worker` on another machine runs its ranks with.
        self._remote_args = (
            pickle.dumps((config, load_settings, self.rendezvous, num_threads))
            if config.nnodes > 1
            else None
        )
        self._finalizer = weakref.finalize(self, _release, self.workers, self._stopping)
        # Rank 0 loads its shard while the workers start; the groups are joined after that.
        self.tp = self.position.tensor_parallel()
        self.stage = self.position.stage
        self.step_group: Any = None
        self.link: StageLink | None = None
        self.weight_bytes: list[int] = []  # per rank, once the runners are built

    def make_runner(
        self, model: LlamaForCausalLM, spec: RunnerSpec, device: torch.device
    ) -> PipelineStageRunner:
        """Rank 0's runner; every worker builds the same one over its shard."""
        self._join()
        self.link = self.collective(lambda: join_stages(self.position, self.tp, self.step_group))
        self.collective(lambda: broadcast_object(spec, self.step_group))
        self.weight_bytes = self.collective(lambda: report_weight_bytes(model, self.step_group))
        return TensorParallelRunner(self, model, spec, device)

    def _join(self) -> None:
        try:
            _, self.step_group = join_group(
                self.rendezvous, 0, self.check_workers, self._remote_args
            )
        except Exception as e:
            self.check_workers()  # a worker that died starting is the better explanation
            self.shutdown(graceful=False)
            raise TensorParallelError(f"the tensor-parallel workers did not join: {e}") from e

    def broadcast_step(self, scheduler_output: SchedulerOutput) -> None:
        self.collective(lambda: broadcast_object(scheduler_output, self.step_group))

    def collective(self, call: Any) -> Any:
        """Run `call` (collectives with the workers), raising `TensorParallelError` if a
        worker is dead, or dies or hangs meanwhile."""
        self.check_workers()
        try:
            return call()
        except Exception as e:
            if _is_collective_error(e):  # a peer's closed connection comes before its exit
                self._await_exit(_EXIT_REPORT_S)
            self.check_workers()
            if not _is_collective_error(e):
                raise
            self._fail(
                "a collective with the tensor-parallel workers failed: one hung (past "
                f"distributed_timeout={self.rendezvous.timeout_s:g} s) or dropped its connection "
                f"({str(e).strip()})"
            )

    def _await_exit(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a worker to have exited (a dead one explains a failure
        best); returns at once if one has."""
        deadline = time.monotonic() + timeout_s
        while all(w.is_alive() for w in self.workers) and time.monotonic() < deadline:
            time.sleep(0.01)

    def check_workers(self) -> None:
        if self.failure is None:
            for rank, worker in enumerate(self.workers, start=1):
                if not worker.is_alive():
                    self._set_failure(_exit_message(rank, worker))
        if self.failure is not None:
            self.shutdown(graceful=False)
            raise self.failure

    def _fail(self, message: str) -> NoReturn:
        self._set_failure(message)
        self.shutdown(graceful=False)
        assert self.failure is not None
        raise self.failure

    def _worker_exited(self, rank: int, worker: Worker) -> None:
        """A watcher thread's report: a worker that exits unasked fails the executor now."""
        if self._stopping.is_set():
            return
        error = self._set_failure(_exit_message(rank, worker))
        if error is not None:
            for other in self.workers:
                other.kill()  # a collective waiting on them fails now, not at the timeout
            if self.on_failure is not None:
                self.on_failure(error)

    def _set_failure(self, message: str) -> TensorParallelError | None:
        """Record the first failure (logged); the error if this call recorded it."""
        with self._lock:
            if self.failure is not None:
                return None
            self.failure = TensorParallelError(message + "; the engine stopped its other workers")
        logger.error("%s", self.failure)
        return self.failure

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (idempotent); graceful: tell them, else kill them."""
        if not self._finalizer.alive:
            return
        self._finalizer.detach()
        self._stopping.set()
        if graceful and self.failure is None and self.step_group is not None:
            try:
                broadcast_object(STOP, self.step_group)
            except Exception:  # a worker already gone: it is killed below
                graceful = False
        leave_group()  # first: a worker's own leaving waits for rank 0's
        _stop_workers(self.workers, graceful)
        torch.set_num_threads(self._engine_threads)


def _is_collective_error(e: Exception) -> bool:
    """Whether `e` came from torch.distributed's transport (gloo raises plain RuntimeErrors)."""
    return isinstance(e, torch.distributed.DistError) or (
        isinstance(e, RuntimeError) and "gloo" in str(e)
    )


def _weak_callback(
    method: weakref.WeakMethod[Callable[[int, Worker], None]], rank: int
) -> Callable[[Worker], None]:
    """A watcher's report to the executor that does not keep it alive (so garbage collection
    still stops the workers)."""

    def report(worker: Worker) -> None:
        if (bound := method()) is not None:
            bound(rank, worker)

    return report


def _exit_message(rank: int, worker: Worker) -> str:
    return f"tensor-parallel worker rank {rank} {worker.describe_exit()}"


def _release(workers: list[Any], stopping: threading.Event) -> None:
    """At garbage collection or interpreter exit without a shutdown: kill, then leave."""
    stopping.set()
    _stop_workers(workers, graceful=False)
    leave_group()


def _stop_workers(workers: list[Any], graceful: bool) -> None:
    for worker in workers:
        if graceful:
            worker.join(_JOIN_TIMEOUT_S)
        if worker.is_alive():
            worker.kill()
        worker.join(_JOIN_TIMEOUT_S)


class TensorParallelRunner(PipelineStageRunner):
    """Rank 0's runner: each step goes to the workers first, then runs here in lockstep (with
    pipeline parallelism: the first stage's part, then the last stage's output comes back)."""

    def __init__(
        self,
        executor: TensorParallelExecutor,
        model: LlamaForCausalLM,
        spec: RunnerSpec,
        device: torch.device,
    ) -> None:
        super().__init__(model, spec, device, executor.link)
        self.executor = executor

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.executor.broadcast_step(scheduler_output)
        step = PipelineStageRunner.execute_model
        return self.executor.collective(lambda: step(self, scheduler_output))
