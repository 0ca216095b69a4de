"""The OpenMP wait policy of torch's threads.

Imported by the package root before anything loads torch: idle OpenMP threads sleep instead
of spinning. On a machine whose cores are shared (a benchmark client beside the server, other jobs),
spinning threads that wait at a barrier for a descheduled peer made a decode step 30x
slower (543 ms vs 17 ms, default model, batch 16, 2 cores, load average 5). Set
OMP_WAIT_POLICY yourself to override. The runtime reads it once, when torch loads: the
engine takes it back out of the environment then (`forget_openmp_wait_policy`), so child
processes (a llama.cpp benchmarked from a tokenmill process, which it made 2-2.7x slower)
inherit the user's environment, not ours.
"""

from __future__ import annotations

import os
import sys

_SET_OMP_WAIT_POLICY = "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules
if _SET_OMP_WAIT_POLICY:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def forget_openmp_wait_policy() -> None:
    """Remove the OMP_WAIT_POLICY tokenmill set, once torch (and its OpenMP runtime) is loaded."""
    global _SET_OMP_WAIT_POLICY
    if _SET_OMP_WAIT_POLICY and "torch" in sys.modules:
        os.environ.pop("OMP_WAIT_POLICY", None)
        _SET_OMP_WAIT_POLICY = False
