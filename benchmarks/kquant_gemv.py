"""Batch-1 products of GGUF K-quant weights against the read roof, quick to set up.

    python -m benchmarks.kquant_gemv [--types Q4_K,Q6_K] [--stream-mb 1024] [--repeats 5]
        [--isa avx512_bf16,avx2]

`benchmarks.gguf_linears` loads every copy through the GGUF loader (minutes for a stream
larger than a big L3); this one loads each type once (`gguf_linears.gguf_layer`) and clones
the packed tensors until the copies hold `--stream-mb`, so each product reads its weight from
memory. Shapes: Llama-3.2-1B's gate/up (8192 x 2048), down (2048 x 8192) and the Q6_K LM head
rows (49152 x 2048). Each ISA level named runs in turn in every round (interleaved, medians).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
from gguf import GGMLQuantizationType as Q

from benchmarks.gguf_linears import gguf_layer, read_bandwidth, resident_bytes
from tokenmill.kernels.int_linear import PackedWeight, native_quant_linear
from tokenmill.kernels.native import ISA_LEVELS, using_isa

SHAPES = (("gate/up", 8192, 2048), ("down", 2048, 8192), ("lm_head", 49152, 2048))


def clone(packed: PackedWeight) -> PackedWeight:
    """A copy with tensors of its own (so each product reads other memory)."""
    return dataclasses.replace(
        packed,
        codes=packed.codes.clone(),
        scales=packed.scales.clone(),
        offsets=None if packed.offsets is None else packed.offsets.clone(),
        super_scales=None if packed.super_scales is None else packed.super_scales.clone(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--types", default="Q4_K,Q6_K")
    parser.add_argument("--stream-mb", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--isa", default="avx512_bf16")
    parser.add_argument("--shapes", default="gate/up,down,lm_head")
    args = parser.parse_args()
    levels = [ISA_LEVELS.index(name) for name in args.isa.split(",")]
    print(f"threads {torch.get_num_threads()}")
    print("| type | linear | isa | us | roof us | of roof | GB/s |\n|---|---|---|---|---|---|---|")
    for type_name in args.types.split(","):
        for shape, rows, cols in SHAPES:
            if shape not in args.shapes.split(",") or (shape == "lm_head" and type_name != "Q6_K"):
                continue
            layer, _ = gguf_layer(Q[type_name], rows, cols, seed=0)
            size = resident_bytes(layer)
            copies = [layer.packed] + [
                clone(layer.packed) for _ in range(max(1, args.stream_mb * 2**20 // size) - 1)
            ]
            natives = [native_quant_linear(c) for c in copies]
            x = torch.randn(1, cols)
            times: dict[int, list[float]] = {level: [] for level in levels}
            bandwidths = []
            for _ in range(args.repeats):
                bandwidths.append(read_bandwidth(args.stream_mb, 1))
                for level in levels:
                    with using_isa(level):
                        start = time.perf_counter()
                        for native in natives:
                            native.forward(x, None, False)
                        times[level].append((time.perf_counter() - start) / len(natives))
            roof = size / statistics.median(bandwidths)
            for level in levels:
                seconds = statistics.median(times[level])
                print(
                    f"| {type_name} | {shape} {rows}x{cols} | {ISA_LEVELS[level]} | "
                    f"{seconds * 1e6:.0f} | {roof * 1e6:.0f} | {roof / seconds:.0%} | "
                    f"{size / seconds / 1e9:.1f} |",
                    flush=True,
                )
            del copies, natives, layer


if __name__ == "__main__":
    main()
