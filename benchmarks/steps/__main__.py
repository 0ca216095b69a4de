"""`python -m benchmarks.steps NAME [ARGS]`: run one of the step profilers by name."""

import importlib
import sys

from benchmarks.steps import PROFILERS

if len(sys.argv) < 2 or sys.argv[1] not in PROFILERS:
    sys.exit(f"usage: python -m benchmarks.steps {{{','.join(PROFILERS)}}} [ARGS]")
name = sys.argv.pop(1)
sys.argv[0] = f"benchmarks.steps {name}"
importlib.import_module(PROFILERS[name]).main()
