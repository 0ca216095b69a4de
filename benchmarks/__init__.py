"""The repository's benchmark scripts, importable as the package `benchmarks`.

Run them from the repository's root as modules (`python -m benchmarks.kv_cache`,
`python -m benchmarks.peers`, `python -m benchmarks.itl`): the root is then on `sys.path`,
which the random-checkpoint helpers (tokenmill_testing/) and the demo models' training
(demo_training/) need. docs/benchmarks.md lists them and their latest results; findings of
experiments that have been deleted are in results/journal/.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
