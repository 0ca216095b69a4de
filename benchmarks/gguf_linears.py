"""Each GGUF type's batch-1 product against its byte roof, at a 1B model's linear shapes.

    flock /tmp/tokenmill-bench.lock python -m benchmarks.gguf_linears [--types Q4_K,Q6_K]
        [--repeats 7] [--stream-mb 256]

For every type and shape (Llama-3.2-1B's: q / o 2048 -> 2048, k / v 2048 -> 512, gate / up
2048 -> 8192, down 8192 -> 2048, and the 49152-row LM head, in Q6_K as Q4_K_M files hold it)
the weight is loaded the way a GGUF file's is (`gguf_blocks.groups`, the layer method its
format names) from random valid blocks, copied until the copies hold `--stream-mb` (so that
each product reads its weight from memory, not from cache), and one row is multiplied by each
copy in turn. The roof is the bytes the layer holds (codes, scales, offsets) over the read
bandwidth measured in the same run (a float32 sum over a buffer of `--stream-mb`, torch on the
same threads). Medians of `--repeats` interleaved rounds; microseconds per product.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from tokenmill.layers.linear import Linear
from tokenmill.quantization.gguf_blocks import _BLOCK_BYTES, groups
from tokenmill.quantization.gguf_file import _format_of
from tokenmill.quantization.selection import find_format

# (name, out, in) of a Llama-3.2-1B-shaped decoder's linears and its LM head.
SHAPES = (
    ("q/o 2048x2048", 2048, 2048),
    ("k/v 512x2048", 512, 2048),
    ("gate/up 8192x2048", 8192, 2048),
    ("down 2048x8192", 2048, 8192),
    ("lm_head 49152x2048", 49152, 2048),
)
TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q4_0", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K")
# Byte offsets of each block's float16 scales (set to small finite values in random blocks).
_HALF_AT = {
    Q.Q8_0: (0,),
    Q.Q4_0: (0,),
    Q.Q5_0: (0,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.Q3_K: (108,),
    Q.Q2_K: (80, 82),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}
_WEIGHTS_PER_BLOCK = {Q.Q8_0: 32, Q.Q4_0: 32, Q.Q5_0: 32, Q.IQ4_NL: 32}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 `[rows, bytes per row]`: random codes, float16 scales in [0, 0.01)."""
    rng = np.random.default_rng(seed)
    per_block = _WEIGHTS_PER_BLOCK.get(qtype, 256)
    blocks = rng.integers(0, 256, (rows * cols // per_block, _BLOCK_BYTES[qtype]), np.uint8)
    for at in _HALF_AT[qtype]:
        scales = (rng.random(len(blocks)) * 0.01).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def gguf_layer(qtype: Q, rows: int, cols: int, seed: int) -> tuple[Linear, str]:
    """A layer holding random `qtype` blocks as a GGUF file's loader makes it."""
    name = _format_of({qtype})
    fmt = find_format(name)
    assert fmt is not None, name
    method = fmt.method(name, None)
    layer = Linear(cols, rows, method, dtype=torch.float32)
    method.load_weight(layer, groups(random_blocks(qtype, rows, cols, seed), qtype), 0)
    method.process_weights_after_loading(layer)
    return layer, name


def resident_bytes(layer: Linear) -> int:
    packed = layer.packed
    parts = (packed.codes, packed.scales, packed.offsets)
    return sum(t.numel() * t.element_size() for t in parts if t is not None)


def read_bandwidth(megabytes: int, repeats: int) -> float:
    """Bytes per second of a float32 sum over `megabytes` (the median of `repeats`)."""
    buffer = torch.ones(megabytes * 2**20 // 4)
    buffer.sum()  # touched once
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return buffer.numel() * 4 / statistics.median(times)


def timed(products: list[Callable[[], object]]) -> float:
    """Seconds per product, over one pass through all copies."""
    start = time.perf_counter()
    for product in products:
        product()
    return (time.perf_counter() - start) / len(products)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--stream-mb", type=int, default=256)
    parser.add_argument("--shapes", default="", help="names containing these, comma-separated")
    args = parser.parse_args()
    wanted = [
        s for s in SHAPES if not args.shapes or any(k in s[0] for k in args.shapes.split(","))
    ]
    print(f"threads: {torch.get_num_threads()}")
    rows = []
    for type_name in args.types.split(","):
        qtype = Q[type_name]
        for shape, out_features, in_features in wanted:
            if shape.startswith("lm_head") and qtype != Q.Q6_K:
                continue
            layer, fmt = gguf_layer(qtype, out_features, in_features, seed=0)
            size = resident_bytes(layer)
            copies = [layer] + [
                gguf_layer(qtype, out_features, in_features, seed=i)[0]
                for i in range(1, max(1, args.stream_mb * 2**20 // size))
            ]
            x = torch.randn(1, in_features)
            products = [lambda layer=c, x=x: layer.native.forward(x, None, False) for c in copies]
            timed(products)  # warm
            times, bandwidths = [], []
            for _ in range(args.repeats):
                bandwidths.append(read_bandwidth(args.stream_mb, 1))
                times.append(timed(products))
            seconds, bandwidth = statistics.median(times), statistics.median(bandwidths)
            roof = size / bandwidth
            bpw = 8 * size / (out_features * in_features)
            rows.append((type_name, fmt, shape, bpw, seconds, roof, size / seconds, bandwidth))
            print(
                f"| {type_name} | {fmt} | {shape} | {bpw:.2f} | {seconds * 1e6:.0f} | "
                f"{roof * 1e6:.0f} | {roof / seconds:.0%} | {size / seconds / 1e9:.1f} | "
                f"{bandwidth / 1e9:.1f} |",
                flush=True,
            )
            del copies, products, layer


if __name__ == "__main__":
    print(
        "| type | held as | linear (out x in) | bits/weight held | us | roof us | of roof | "
        "GB/s | read GB/s |\n|---|---|---|---|---|---|---|---|---|"
    )
    main()
