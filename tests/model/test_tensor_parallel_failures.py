"""Tensor parallelism failing and ending: a killed or hung worker fails the engine with a clear
error in bounded time; no worker outlives its engine. (A module of its own: one tensor-parallel
engine per process, and test_tensor_parallel.py keeps one alive until its module ends.)"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.worker.tp_executor import TensorParallelError

PROMPT = [random.Random(0).randrange(10, 1000) for _ in range(12)]


def tiny_tp_engine(tiny_checkpoint, **kwargs) -> LLM:
    checkpoint = str(tiny_checkpoint("llama", num_hidden_layers=1))
    return LLM(checkpoint, dtype="float32", tensor_parallel_size=2, **kwargs)


def test_a_killed_worker_fails_the_engine_clearly(tiny_checkpoint) -> None:
    llm = tiny_tp_engine(tiny_checkpoint)
    worker = llm.engine.parts.executor.workers[0]
    try:
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(TensorParallelError):  # and stays failed
            llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_a_hung_worker_fails_the_engine_within_the_timeout(tiny_checkpoint) -> None:
    llm = tiny_tp_engine(tiny_checkpoint, distributed_timeout=2)
    worker = llm.engine.parts.executor.workers[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"collective .* failed"):
            llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)
        # A hang guard, not a measurement: the collective gives up after 2 s; a hung engine
        # would wait forever.
        assert time.monotonic() - start < 120
        assert not worker.is_alive()  # killed, though stopped
    finally:
        llm.engine.shutdown()


def test_no_worker_outlives_its_engine_process(tiny_checkpoint, tmp_path: Path) -> None:
    """An engine process that exits without shutting down leaves no workers behind."""
    checkpoint = str(tiny_checkpoint("llama", num_hidden_layers=1))
    script = tmp_path / "engine.py"
    script.write_text(
        textwrap.dedent(f"""
            from tokenmill import LLM
            if __name__ == "__main__":
                llm = LLM({checkpoint!r}, dtype="float32", tensor_parallel_size=2)
                print(*(w.pid for w in llm.engine.parts.executor.workers), flush=True)
        """)
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=True
    )
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 1
    for pid in pids:
        assert not _running(pid), f"worker {pid} outlived its engine"


# A script as vLLM users write them: no `if __name__ == "__main__":`. It runs one rank first,
# so the OpenMP pool has run before the workers start (what a forked worker would hang on).
PLAIN_SCRIPT = """
import json
from tokenmill import LLM, SamplingParams

params = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=1.0, seed=3)]
outputs = dict()
for size in (1, 2):
    llm = LLM({checkpoint!r}, dtype="float32", tensor_parallel_size=size)
    results = llm.generate([{prompt!r}] * 2, params, use_tqdm=False)
    outputs[size] = [r.outputs[0].token_ids for r in results]
    llm.shutdown()
print(json.dumps(outputs))
"""


def test_a_plain_script_without_a_main_guard_runs_tensor_parallel(
    tiny_checkpoint, tmp_path: Path
) -> None:
    checkpoint = str(tiny_checkpoint("llama", num_hidden_layers=1))
    script = tmp_path / "plain.py"
    script.write_text(PLAIN_SCRIPT.format(checkpoint=checkpoint, prompt=PROMPT))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "bootstrapping phase" not in done.stderr
    outputs = json.loads(done.stdout.splitlines()[-1])
    assert len(outputs["2"]) == 2 and all(len(tokens) == 6 for tokens in outputs["2"])
    assert outputs["2"] == outputs["1"]


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status").read_text()
    return "zombie" not in status
