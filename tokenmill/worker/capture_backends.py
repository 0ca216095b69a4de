"""How a captured decode step is made (`worker/captured_step.py` decides when and on what).

A capture takes a forward over fixed input buffers and returns what each step calls to run
it again on the buffers' new contents:
- `eager_capture`: the forward itself (the bucketed bookkeeping without a compiler: tests).
- `compile_forward` + `first_call_capture`: one `torch.compile` of the model's forward with
  static shapes; each new key compiles its own graph on its first call (inductor's C++
  backend on the CPU; inductor caches the compiled code on disk, so a restart mostly loads it).
- `cuda_graph_capture_factory`: a CUDA graph per key, sharing one memory pool, replayed each step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Replay = Callable[[], torch.Tensor]


def eager_capture(run: Replay) -> Replay:
    return run


def compile_forward(
    forward: Callable[..., torch.Tensor], max_keys: int, backend: str = "inductor"
) -> Callable[..., torch.Tensor]:
    """`forward` compiled with static shapes: each key's first call compiles its own graph.
    `backend="aot_eager"` traces the same graph without generating code (tests: seconds, where
    inductor takes tens)."""
    import torch._dynamo

    # One graph per key; past dynamo's limit (8 by default) it would fall back to eager
    # silently.
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, max_keys)
    if backend != "inductor":
        return torch.compile(forward, dynamic=False, backend=backend)
    # Freezing folds the weights into the graph as constants (inductor may then pick a
    # oneDNN layout for them; on an AVX2-only CPU it kept aten::mm: docs/benchmarks.md).
    return torch.compile(forward, dynamic=False, options={"freezing": True})


def first_call_capture(run: Replay) -> Replay:
    """For a compiled forward: the first call compiles (timed and logged by the caller)."""
    run()
    return run


def cuda_graph_capture_factory(device: torch.device, warmup: int = 2) -> Callable[[Replay], Replay]:
    """Captures share one memory pool (vLLM captures the largest batch first so smaller ones
    reuse its memory; here keys come in first-use order)."""
    pool = None

    def capture(run: Replay) -> Replay:
        nonlocal pool
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # lazy initialisations happen outside the graph
                run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = run()
        pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    return capture
