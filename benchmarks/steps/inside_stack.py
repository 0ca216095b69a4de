"""Where a decode step's wall time goes inside the native jobs, by kind of phase.

    python -m benchmarks.steps inside-stack [--model PATH] [--batch 1] [--steps 30]

`benchmarks.steps split` stops at the fused decoder stack: it is one native call. This turns
on the kernels' phase profile (`phase_profile_enable`): every phased job's caller stamps each
phase boundary, so each kind of phase (a linear's products by role, preparing their input rows,
attention, RoPE and the cache write, norms, the activation, MoE routing, the LM head's own call,
argmax) gets its wall time, barrier waits included. "Outside the native phases" is the step's
wall time less all of them: Python, torch ops, scheduling, sampling.
Prints, per kind: milliseconds per step, phases per step, microseconds per phase, its share of
the step, and for products the weight bytes read per second.
Default model: the SmolLM2-135M-shaped random model (`tokenmill bench make-model --preset smollm`).
"""

from __future__ import annotations

import argparse
import random
import time

from tokenmill import LLM, SamplingParams
from tokenmill.kernels.native import native_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-model-len", type=int, default=512)
    args = parser.parse_args()
    kernels = native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels are not available on this machine")
    if args.model is None:
        from tokenmill.bench.random_model import PRESETS

        args.model = str(PRESETS["smollm"].model_dir())
    llm = LLM(model=args.model, max_model_len=args.max_model_len)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 40, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [rng.randrange(10, 2000) for _ in range(128)], params)
    for _ in range(10):  # prefill, then steady decoding
        engine.step()
    kernels.phase_profile_take()
    kernels.phase_profile_enable(True)
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - start) / args.steps
    kernels.phase_profile_enable(False)
    totals = kernels.phase_profile_take()
    engine.abort_request([str(i) for i in range(args.batch)])

    print(f"batch {args.batch}: step {wall * 1e3:.2f} ms wall, {args.steps} steps")
    print(f"  {'phase kind':<22}{'ms/step':>9}{'phases':>8}{'us each':>9}{'share':>8}{'GB/s':>7}")
    inside = 0.0
    for label, (nanoseconds, phases, weight_bytes) in sorted(
        totals.items(), key=lambda item: -item[1][0]
    ):
        seconds = nanoseconds / 1e9 / args.steps
        inside += seconds
        each = nanoseconds / 1e3 / phases
        rate = f"{weight_bytes / nanoseconds:7.1f}" if weight_bytes else ""
        print(
            f"  {label:<22}{seconds * 1e3:9.2f}{phases / args.steps:8.0f}{each:9.1f}"
            f"{seconds / wall:8.1%}{rate}"
        )
    outside = wall - inside
    print(f"  {'outside native phases':<22}{outside * 1e3:9.2f}{'':17}{outside / wall:8.1%}")


if __name__ == "__main__":
    main()
