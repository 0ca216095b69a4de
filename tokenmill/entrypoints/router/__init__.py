"""`tokenmill router`: one OpenAI endpoint in front of several `tokenmill serve` replicas
(docs/scale_out.md). Here the proxy both fronts share (`app.py`, its checks `guard.py`, its
`metrics.py`); `balancing/` chooses a replica, `disaggregation/` splits a request between a
prefill and a decode instance, `launching/` starts the router and the processes behind it."""
