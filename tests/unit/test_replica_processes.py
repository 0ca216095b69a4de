"""`serve --data-parallel-size` replicas die with their parent even when it is SIGKILLed (the
SIGTERM path is checked by tests/server/router/conftest.py's teardown)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PARENT = """
import subprocess, sys
from tokenmill.entrypoints.router.launching.supervisor import _die_with_parent
child = subprocess.Popen(["sleep", "60"], preexec_fn=_die_with_parent)
print(child.pid, flush=True)
child.wait()
"""


def test_a_replica_gets_sigterm_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, env={**os.environ}, text=True
    )
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the replica outlived its killed parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
