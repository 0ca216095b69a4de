"""Offline throughput with linear layers on oneDNN-reordered weights vs torch's F.linear.

    python -m benchmarks.linear_backend [--model PATH] [--repeats 3]

Batches of 1, 16 and 64 concurrent requests (2x as many requests as slots, at least 4;
128-token prompts, 64 generated tokens each, greedy, ignore_eos): tokens/s of each backend,
median of interleaved repeats, and the ratio. Default model: the demo target; the 79M model
of `tokenmill bench make-model` shows a model whose matmuls dominate.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tokenmill import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    rng = random.Random(0)
    print(f"{'concurrency':>11} {'torch tok/s':>12} {'oneDNN tok/s':>13} {'ratio':>6}")
    for concurrency in (1, 16, 64):
        engines = {
            backend: LLM(
                model=args.model, dtype="float32", max_num_seqs=concurrency, linear_backend=backend
            )
            for backend in ("torch", "auto")
        }
        count = max(2 * concurrency, 4)
        prompts = [[rng.randrange(10, 2000) for _ in range(128)] for _ in range(count)]
        rates: dict[str, list[float]] = {backend: [] for backend in engines}
        for _ in range(args.repeats):
            for backend, llm in engines.items():
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                rates[backend].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
        torch_rate, onednn_rate = (statistics.median(rates[b]) for b in ("torch", "auto"))
        print(
            f"{concurrency:>11} {torch_rate:>12.1f} {onednn_rate:>13.1f} "
            f"{onednn_rate / torch_rate:>5.2f}x",
            flush=True,
        )
        del engines


if __name__ == "__main__":
    main()
