"""Decode-step time of attention backends on the CPU, side by side, interleaved.

    OMP_NUM_THREADS=1 python benchmarks/attention_backend.py [--model PATH] [--rounds 5]

For each batch size, one engine per backend (`--backends`, default `torch,cpu`) takes the same
B requests (random prompts of 96-160 tokens, so decodes of different lengths share a step and
need a mask; greedy, ignore_eos), runs them into steady decoding, then `--rounds` times in
turn times `--steps` decode steps of each engine: process CPU time per step (what a shared
machine's load disturbs least) and wall time per step, medians, and each backend's ratio to the
first. Default model: the SmolLM2-135M-shaped random model (make_smollm_shaped_model.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tokenmill import LLM, SamplingParams


def time_steps(llm: LLM, steps: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per engine step over `steps` steps."""
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(steps):
        llm.engine.step()
    return (time.process_time() - cpu_start) / steps, (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--backends", default="torch,cpu")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.model is None:
        from make_smollm_shaped_model import model_dir

        args.model = str(model_dir())
    backends = args.backends.split(",")
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    print("batch " + " ".join(f"{b + ' cpu ms':>12} {b + ' wall ms':>13}" for b in backends))
    for batch in (int(b) for b in args.batches.split(",")):
        rng = random.Random(batch)
        prompts = [
            [rng.randrange(10, 2000) for _ in range(rng.randint(96, 160))] for _ in range(batch)
        ]
        engines = {}
        for backend in backends:
            llm = LLM(
                model=args.model,
                dtype=args.dtype,
                max_model_len=1024,
                max_num_seqs=max(batch, 1),
                attention_backend=backend,
            )
            for i, prompt in enumerate(prompts):
                llm.engine.add_request(str(i), prompt, params)
            for _ in range(8):  # prefill, then a few decodes
                llm.engine.step()
            engines[backend] = llm
        samples: dict[str, list[tuple[float, float]]] = {b: [] for b in backends}
        for _ in range(args.rounds):
            for backend, llm in engines.items():
                samples[backend].append(time_steps(llm, args.steps))
        medians = {
            b: (statistics.median(s[0] for s in v), statistics.median(s[1] for s in v))
            for b, v in samples.items()
        }
        base_cpu = medians[backends[0]][0]
        cells = [f"{cpu * 1e3:>12.2f} {wall * 1e3:>13.2f}" for cpu, wall in medians.values()]
        ratios = " ".join(f"{base_cpu / medians[b][0]:.2f}x" for b in backends[1:])
        print(
            f"{batch:>5} " + " ".join(cells) + f"   cpu-time speed-up vs {backends[0]}: {ratios}",
            flush=True,
        )
        del engines


if __name__ == "__main__":
    main()
