"""`python -m benchmarks.itl`: inter-token latency while a long prompt arrives (scenario.py)."""

from benchmarks.itl.scenario import main

main()
