"""Starting a tensor-parallel worker as a fresh interpreter, and watching it exit.

Not `multiprocessing`: its *spawn* re-imports the parent's main module in every child, so a
plain script that builds `LLM(..., tensor_parallel_size=2)` without an
`if __name__ == "__main__":` guard ran itself again in each worker and crashed in the spawn
bootstrap. Its *fork* copies a process whose OpenMP pool has already run (any torch op), and
libgomp's child then hangs in its first parallel region. A worker here is
`python -m tokenmill.worker.worker_process` with its arguments pickled on stdin: nothing of the
caller's script runs in it, nothing of the caller's threads is copied, and CUDA starts fresh.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

WORKER_MODULE = "tokenmill.worker.worker_process"  # this file: its __main__ below


class WorkerProcess:
    """One worker: `pid`, `exitcode` (None while running; -N for signal N), `is_alive()`,
    `join()`, `kill()`, as `multiprocessing.Process` names them. `on_exit(self)` runs on a
    watcher thread as soon as the process exits."""

    def __init__(
        self, name: str, args: tuple[Any, ...], on_exit: Callable[[WorkerProcess], None]
    ) -> None:
        self.name = name
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._popen = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE, env=env
        )
        self.pid = self._popen.pid
        assert self._popen.stdin is not None
        # A worker that died at once closed the pipe: the watcher reports its exit code.
        with contextlib.suppress(BrokenPipeError), self._popen.stdin as stdin:
            stdin.write(pickle.dumps(args))
        self._exited = threading.Event()
        self._on_exit = on_exit
        threading.Thread(target=self._watch, name=f"{name}-watch", daemon=True).start()

    def _watch(self) -> None:
        self._popen.wait()
        self._exited.set()
        self._on_exit(self)

    @property
    def exitcode(self) -> int | None:
        return self._popen.returncode if self._exited.is_set() else None

    def is_alive(self) -> bool:
        return not self._exited.is_set()

    def describe_exit(self) -> str:
        return f"(pid {self.pid}) exited with code {self.exitcode}"

    def join(self, timeout: float | None = None) -> None:
        self._exited.wait(timeout)

    def kill(self) -> None:
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):  # exited meanwhile
                self._popen.kill()


if __name__ == "__main__":  # a worker: run `tp_worker.run_worker` on the parent's arguments
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    from tokenmill.worker.tp_worker import run_worker

    run_worker(*pickle.loads(sys.stdin.buffer.read()))
