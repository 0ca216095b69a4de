"""KV cache benchmarks (issue: prefix caching, FP8 KV), offline, side by side in one run.

    python -m benchmarks.kv_cache [--model PATH] [--repeats 3]

1. shared-prefix: a ~1,000-token system prompt shared by every request, varied user suffixes:
   throughput and p50 TTFT with prefix caching on vs off.
2. zero-hit overhead: unique prompts, prefix caching on vs off (the cost of hashing and lookups).
3. FP8 vs float32 KV at equal memory: peak concurrent sequences and throughput under a load
   that saturates the cache.
Each configuration keeps its engine; runs are interleaved and the median is reported.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tokenmill import LLM, SamplingParams


def shared_prefix_prompts(n: int, prefix_len: int, suffix_len: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(10, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(10, vocab) for _ in range(suffix_len)] for _ in range(n)]


def unique_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Generates, then reports output tokens/s, median TTFT and the peak number running."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    start = time.perf_counter()
    stamp = time.time()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{stamp}-{i}", prompt, params)
    peak_running, finished = 0, []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
        peak_running = max(peak_running, engine.get_stats().scheduler.num_running)
    seconds = time.perf_counter() - start
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in finished]
    return {
        "tok_per_s": len(prompts) * max_tokens / seconds,
        "ttft_p50": statistics.median(ttfts),
        "peak_running": peak_running,
    }


def compare(
    name: str, engines: dict[str, LLM], make_prompts, max_tokens: int, repeats: int
) -> dict[str, dict[str, float]]:
    results: dict[str, list[dict[str, float]]] = {label: [] for label in engines}
    for repeat in range(repeats):
        for label, llm in engines.items():
            llm.reset_prefix_cache()
            results[label].append(run(llm, make_prompts(repeat), max_tokens))
    medians = {
        label: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for label, runs in results.items()
    }
    print(f"\n## {name} (median of {repeats})")
    for label, m in medians.items():
        print(
            f"  {label:<24} {m['tok_per_s']:8.1f} out tok/s"
            f"   p50 TTFT {m['ttft_p50'] * 1000:8.1f} ms   peak running {m['peak_running']:.0f}"
        )
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=32)
    args = parser.parse_args()
    common = {"model": args.model, "max_model_len": 2048, "max_num_batched_tokens": 2048}

    on = LLM(**common, enable_prefix_caching=True)
    off = LLM(**common, enable_prefix_caching=False)
    vocab = on.engine.vocab_size
    n = args.num_prompts

    shared = compare(
        "shared 1,000-token system prompt, 64-token user parts, 32 output tokens",
        {"prefix caching on": on, "prefix caching off": off},
        lambda r: shared_prefix_prompts(n, 1000, 64, vocab),
        32,
        args.repeats,
    )
    ratio = shared["prefix caching on"]["tok_per_s"] / shared["prefix caching off"]["tok_per_s"]
    ttft = shared["prefix caching off"]["ttft_p50"] / shared["prefix caching on"]["ttft_p50"]
    print(f"  throughput on/off: {ratio:.2f}x, p50 TTFT off/on: {ttft:.2f}x")

    zero = compare(
        "0% hit rate: unique 512-token prompts, 32 output tokens",
        {"prefix caching on": on, "prefix caching off": off},
        lambda r: unique_prompts(n, 512, vocab, seed=100 + r),
        32,
        args.repeats,
    )
    overhead = 1 - zero["prefix caching on"]["tok_per_s"] / zero["prefix caching off"]["tok_per_s"]
    print(f"  prefix-caching overhead at 0% hits: {overhead:+.1%}")
    del on, off

    budget = 16 * 1024 * 1024
    kv = {
        "float32 KV": LLM(**common, kv_cache_memory=budget, enable_prefix_caching=False),
        "fp8 KV": LLM(
            **common, kv_cache_memory=budget, kv_cache_dtype="fp8", enable_prefix_caching=False
        ),
    }
    for label, llm in kv.items():
        print(f"  {label}: {llm.get_stats().scheduler.num_kv_blocks} blocks in {budget >> 20} MiB")
    fp8 = compare(
        f"equal KV memory ({budget >> 20} MiB), 64 requests of 256 prompt + 128 output tokens",
        kv,
        lambda r: unique_prompts(64, 256, vocab, seed=200 + r),
        128,
        args.repeats,
    )
    print(
        "  fp8/float32: peak running "
        f"{fp8['fp8 KV']['peak_running'] / fp8['float32 KV']['peak_running']:.2f}x, throughput "
        f"{fp8['fp8 KV']['tok_per_s'] / fp8['float32 KV']['tok_per_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
