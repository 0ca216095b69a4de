"""Offline throughput with one rank vs two tensor-parallel ranks, interleaved in one process.

Both engines stay up; each repeat runs the same workload on one, then the other. The one-rank
engine gets all of torch's threads, each of the two ranks half of them (what the executor
sets), so both use the same cores. Greedy outputs are checked equal. Median tokens/s and the
ratio are printed.

    OMP_NUM_THREADS=2 python benchmarks/tensor_parallel.py --repeats 3
    # model: benchmarks/make_bench_model.py's 79M Llama (12 heads, 4 KV heads: splits in 2)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from make_bench_model import NAME, SHAPE, cached_random_model

from tokenmill import LLM, SamplingParams
from tokenmill.bench.throughput import make_workload


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the 79M bench model")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = args.model or str(cached_random_model(NAME, **SHAPE))
    workload = make_workload(
        args.num_prompts,
        (args.input_len, args.input_len),
        (args.output_len, args.output_len),
        2048,
        seed=0,
    )
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in workload.output_lens
    ]
    threads = torch.get_num_threads()
    engines = {
        1: LLM(model, dtype="float32"),
        2: LLM(model, dtype="float32", tensor_parallel_size=2),
    }
    rank_threads = torch.get_num_threads()  # what the executor set for rank 0
    seconds: dict[int, list[float]] = {1: [], 2: []}
    outputs: dict[int, list] = {}
    for _ in range(args.repeats + 1):  # the first round warms up, unrecorded
        for tp, llm in engines.items():
            torch.set_num_threads(threads if tp == 1 else rank_threads)
            elapsed, outputs[tp] = run(llm, workload.prompts, params)
            seconds[tp].append(elapsed)
    engines[2].shutdown()
    assert outputs[1] == outputs[2], "tensor-parallel outputs differ"
    tokens = workload.num_output_tokens
    rates = {tp: tokens / statistics.median(s[1:]) for tp, s in seconds.items()}
    print(
        f"model {model}, {args.num_prompts} prompts x {args.input_len} in + {args.output_len} out"
    )
    print(f"threads: TP=1 {threads}, TP=2 {rank_threads} per rank; repeats {args.repeats}")
    for tp, rate in rates.items():
        print(
            f"TP={tp}: {rate:8.1f} output tok/s (median; runs {[round(s, 2) for s in seconds[tp]]})"
        )
    print(f"TP=2 / TP=1: {rates[2] / rates[1]:.2f}x")


if __name__ == "__main__":
    main()
