"""Where an engine step's time goes, one profiler per question:

    python -m benchmarks.steps profile [--batch 1] [--steps 20]      # torch.profiler's op table
    python -m benchmarks.steps split [--batch 1] [--steps 30]        # outside / linears / attention
    python -m benchmarks.steps inside-stack [--batch 1] [--steps 30]  # native phases, by kind
    python -m benchmarks.steps outside-forward [--batches 1,16,64]   # outside the forward, by phase
    python -m benchmarks.steps cost-by-rows                          # decode and prefill rows

Each module runs on its own too (`python -m benchmarks.steps.split`).
"""

PROFILERS = {
    "profile": "benchmarks.steps.profile",
    "split": "benchmarks.steps.split",
    "inside-stack": "benchmarks.steps.inside_stack",
    "outside-forward": "benchmarks.steps.outside_forward",
    "cost-by-rows": "benchmarks.steps.cost_by_rows",
}
