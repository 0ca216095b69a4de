"""One engine step's vocabulary: a request as the scheduler sees it (`request.py`) and as the
runner remembers it (`runner_request_state.py`), what the scheduler hands the runner
(`scheduler_output.py`), what the runner hands back (`runner_output.py`), what the step did
for each request (`request_step_output.py`), and where a step's tokens go in the paged KV
cache (`layout.py`). Below the scheduler, the KV connectors, the proposers and the runner,
which all speak it."""
