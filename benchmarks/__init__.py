"""The repository's benchmark scripts, importable as the package `benchmarks`.

Run them from the repository's root as modules (`python -m benchmarks.kv_cache`,
`python -m benchmarks.peers`, `python -m benchmarks.steps split`): the root is then on
`sys.path`, which the random-checkpoint helpers (tokenmill_testing/) and the demo models'
training (demo_training/) need. What users run is in `tokenmill bench` (throughput, serve,
sweep, compare, itl, make-model). docs/benchmarks.md lists them and their latest results;
findings of experiments that have been deleted are in results/journal/.
"""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
