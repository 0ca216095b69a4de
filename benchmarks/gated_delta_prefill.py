"""One linear layer's prompt chunk of the gated delta rule (Qwen3.5-9B-like: 16 key heads, 32
value heads, 128 x 128 states, float32): the native kernel against the torch chunked form,
interleaved, median of 7 calls after 2 warm-ups (docs/hybrid_models.md).

    flock /tmp/bench.lock python -m benchmarks.gated_delta_prefill
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from tokenmill.kernels import gated_delta
from tokenmill.layers.gated_delta_rule import chunked_delta_rule, normalize_qk

K_HEADS, V_HEADS, K_DIM, V_DIM = 16, 32, 128, 128


def median_ms(calls: dict[str, Callable[[], object]], repeats: int = 7) -> dict[str, float]:
    for call in calls.values():
        call(), call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def chunk_ms(tokens: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(tokens, K_HEADS, K_DIM, generator=gen) for _ in range(2))
    v = torch.randn(tokens, V_HEADS, V_DIM, generator=gen)
    decay = -torch.rand(tokens, V_HEADS, generator=gen) * 0.1
    beta = torch.rand(tokens, V_HEADS, generator=gen)
    states = [torch.zeros(V_HEADS, K_DIM, V_DIM) for _ in range(2)]
    return median_ms(
        {
            "torch": lambda: chunked_delta_rule(
                *normalize_qk(q, k, V_HEADS), v, decay, beta, states[0]
            ),
            "native": lambda: gated_delta.prefill_delta_rule_(q, k, v, decay, beta, states[1]),
        }
    )


def main() -> None:
    print("| tokens in the chunk | torch chunked | native | speed-up |\n|---|---|---|---|")
    for tokens in (16, 64, 512):
        ms = chunk_ms(tokens)
        speedup = ms["torch"] / ms["native"]
        print(f"| {tokens} | {ms['torch']:.2f} ms | {ms['native']:.2f} ms | {speedup:.1f}x |")


if __name__ == "__main__":
    main()
