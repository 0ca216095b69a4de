"""The native MoE kernel at one layer of Qwen3-30B-A3B's ratios (hidden 2048, 64 experts of
width 768, 8 active; the `qwen3-moe` bench preset's), its one pool job against its per-expert
path (each active expert's two products in turn), interleaved, medians:

    python -m benchmarks.moe_kernel [--format q4k|int8|bf16] [--tokens 1,16] [--reps 200]

Also the bytes the active experts' weights take and the GB/s a call reads at B = 1 (the
kernel's own share of the active-bytes roof). Random routing, a fixed seed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenmill.kernels.int_linear import native_quant_linear, pack
from tokenmill.kernels.moe import moe_kernel
from tokenmill.kernels.native import native_kernels
from tokenmill.layers.fused_moe import route

HIDDEN, WIDTH, EXPERTS, TOP_K = 2048, 768, 64, 8


def linear(rows: int, cols: int, fmt: str, generator: torch.Generator):
    module = native_kernels()
    assert module is not None
    if fmt == "bf16":
        weight = (torch.randn(rows, cols, generator=generator) / cols**0.5).bfloat16()
        return module.PackedLinear.dense(
            module.pack_linear_weight(weight), rows, cols
        ), 2 * rows * cols
    bits = 4 if fmt == "q4k" else 8
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = torch.randint(low, high + 1, (rows, cols), generator=generator)
    subs = torch.randint(1, 64, (rows, cols // 32), generator=generator).float()
    offsets = torch.randn(rows, cols // 32, generator=generator).half() / 64 if bits == 4 else None
    packed = pack(codes, (subs * 2.0**-12).half(), offsets, bits, 32)
    stored = packed.codes.numel() + packed.scales.numel() * packed.scales.element_size()
    if packed.super_scales is not None:
        stored += packed.super_scales.numel() * 2
    if packed.offsets is not None:
        stored += packed.offsets.numel() * 2
    return native_quant_linear(packed), stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--format", default="q4k", choices=["q4k", "int8", "bf16"])
    parser.add_argument("--tokens", default="1,16")
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    gate_up = [linear(2 * WIDTH, HIDDEN, args.format, generator) for _ in range(EXPERTS)]
    down = [linear(HIDDEN, WIDTH, args.format, generator) for _ in range(EXPERTS)]
    expert_bytes = gate_up[0][1] + down[0][1]
    kernels = {
        name: moe_kernel([g for g, _ in gate_up], [d for d, _ in down], WIDTH, per_expert=flag)
        for name, flag in (("one job", False), ("per expert", True))
    }
    dtype = torch.bfloat16
    print(f"format {args.format}, {torch.get_num_threads()} threads, "
          f"{TOP_K * expert_bytes / 1e6:.1f} MB of active experts a token")  # fmt: skip
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for _ in range(args.reps):
            logits = torch.randn(tokens, EXPERTS, generator=generator)
            weights, ids = route(logits, TOP_K, True)
            for name, kernel in kernels.items():
                start = time.perf_counter()
                kernel(x, weights, ids)
                times[name].append(time.perf_counter() - start)
        for name, measured in times.items():
            median = statistics.median(measured[args.reps // 10 :])
            line = f"B={tokens:>3} {name:>10}: {median * 1e6:8.0f} us"
            if tokens == 1:
                line += f"  {TOP_K * expert_bytes / median / 1e9:5.1f} GB/s"
            print(line)


if __name__ == "__main__":
    main()
