"""Puts the repository's root on `sys.path`: the random-checkpoint helpers (tokenmill_testing/)
and the demo models' training (demo_training/) live there, outside the installed package.
A benchmark that uses them imports this module first."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
