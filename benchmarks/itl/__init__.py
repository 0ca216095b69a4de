"""Issue 19's scenario: inter-token latency of decoding streams while a long prompt arrives.

    python -m benchmarks.itl [--repeats 1]                      # offline, every configuration
    python -m benchmarks.itl --server [--llama-cpp-bin DIR]     # over HTTP
    python -m benchmarks.itl.disagg_diagnose                    # the disaggregated decode side

`scenario` runs it offline and drives the served runs, `serving` streams it over HTTP, `stats`
makes one configuration's result and table row.
"""
