"""Decode attention alone: the native paged-attention kernel on one sequence's query.

    python -m benchmarks.paged_attention [--contexts 140,1000] [--dtypes float32,bfloat16]
        [--isa avx2] [--heads 32] [--kv-heads 8] [--head-dim 64] [--repeats 200]

Llama-3.2-1B's attention shape by default (32 query heads over 8 KV heads of 64): a float32
or bfloat16 cache in blocks of 16, a B = 1 decode query, `--repeats` calls after a warm-up,
median and best microseconds per call (one layer's attention). Run it in two trees to compare
kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.kernels.native import ISA_LEVELS, native_kernels, using_isa

BLOCK_SIZE = 16


def time_call(kernels, context: int, dtype: torch.dtype, args: argparse.Namespace) -> list[float]:
    blocks = -(-context // BLOCK_SIZE)
    cache = torch.randn(2, blocks, BLOCK_SIZE, args.kv_heads, args.head_dim).to(dtype)
    query = torch.randn(1, args.heads, args.head_dim)
    out = torch.empty_like(query)
    block_table = torch.randperm(blocks).view(1, -1)  # scattered, as a cache's blocks are
    query_start = torch.tensor([0, 1], dtype=torch.int32)
    seq_lens = torch.tensor([context], dtype=torch.int32)
    scale, no_sinks = args.head_dim**-0.5, torch.empty(0)

    def call() -> None:
        kernels.paged_attention(
            query, cache, block_table, query_start, seq_lens, 0, scale, out, no_sinks, 0.0
        )

    for _ in range(20):
        call()
    samples = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--contexts", default="140,1000")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--isa", default=None, help="an ISA level name (default: the CPU's best)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    kernels = native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels are not available on this machine")
    level = ISA_LEVELS.index(args.isa) if args.isa else kernels.get_isa()
    print(f"threads {torch.get_num_threads()}, isa {ISA_LEVELS[level]}")
    print("| cache | context | median us | best us |\n|---|---|---|---|")
    with using_isa(level):
        for name in args.dtypes.split(","):
            for context in (int(c) for c in args.contexts.split(",")):
                samples = time_call(kernels, context, getattr(torch, name), args)
                print(
                    f"| {name} | {context} | {statistics.median(samples) * 1e6:.1f} | "
                    f"{min(samples) * 1e6:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
