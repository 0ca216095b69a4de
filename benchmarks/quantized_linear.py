"""Quantized linear products against float ones and against torch's int8/int4 ops, on the
shapes of SmolLM2-135M (hidden 576, 9 / 3 heads of 64, MLP 1536: qkv, o, gate_up, down).

    python -m benchmarks.quantized_linear [--rows 1,8,16,64,128,256,1024] [--layers 30]
        [--repeats 5] [--threads 1]

One pass is each layer's four products for `--layers` copies (so that the weights stream from
memory as in a model, not from cache) at each row count. Formats: float32 through oneDNN (the
engine's CPU default), bfloat16 `F.linear` (oneDNN; AMX tiles where the CPU has them), the
native kernels' int8 per row, int8 in groups of 32 (GGUF Q8_0) and int4 in groups of 32 with
offsets (Q4_K, `--quantization int4`) as the layers run them (dot-product kernel; AMX tiles
on chunk-wise bfloat16 dequantization from `quant_amx_min_rows()` rows where AMX runs), and
torch's `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu` (the fallback without a
compiler). Interleaved repeats,
medians, milliseconds per pass and the ratio to float32. With one thread (the default) times
are the thread's CPU time, which load from other jobs disturbs least.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from tokenmill.layers.linear import DenseLinearMethod, Linear, LinearMethod, OneDNNLinearMethod
from tokenmill.quantization.int4 import Int4LinearMethod
from tokenmill.quantization.int8 import Int8LinearMethod

# (in, out) of qkv, o, gate_up, down in SmolLM2-135M.
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
Product = Callable[[torch.Tensor], torch.Tensor]


def layer(method: LinearMethod, weight: torch.Tensor) -> Product:
    out_features, in_features = weight.shape
    dense = method.holds_float_weight
    param = nn.Parameter(weight, requires_grad=False) if dense else None
    linear = Linear(in_features, out_features, method, weight=param, dtype=weight.dtype)
    if not dense:
        method.load_weight(linear, weight.float(), 0)
    method.process_weights_after_loading(linear)
    return linear


def torch_int8(weight: torch.Tensor) -> Product:
    scales = weight.abs().amax(dim=1) / 127
    codes = (weight / scales[:, None]).round().to(torch.int8)
    scales = scales.to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), codes, scales)


def torch_int4(weight: torch.Tensor) -> Product:
    out_features, in_features = weight.shape
    codes = torch.randint(0, 16, weight.shape, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scale_zeros = torch.full((in_features // 32, out_features, 2), 0.01, dtype=torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), packed, 32, scale_zeros
    )


FORMATS: dict[str, Callable[[torch.Tensor], Product]] = {
    "float32": lambda w: layer(OneDNNLinearMethod(), w),
    "bfloat16": lambda w: layer(DenseLinearMethod(torch.bfloat16), w.bfloat16()),
    "int8": lambda w: layer(Int8LinearMethod(), w),
    "int8-g32": lambda w: layer(Int8LinearMethod(32), w),
    "int4-g32": lambda w: layer(Int4LinearMethod(32), w),
    "torch-int8": torch_int8,
    "torch-int4": torch_int4,
}


def time_pass(products: list[Product], inputs: dict[int, torch.Tensor], clock) -> float:
    start = clock()
    for product, in_features in products:
        product(inputs[in_features])
    return clock() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,8,16,64,128,256,1024")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    formats = args.formats.split(",")
    generator = torch.Generator().manual_seed(0)
    weights = [
        torch.randn(out_features, in_features, generator=generator) * 0.05
        for _ in range(args.layers)
        for in_features, out_features in SHAPES
    ]
    passes = {f: [(FORMATS[f](w), w.shape[1]) for w in weights] for f in formats}
    print(f"{'rows':>5} " + " ".join(f"{f + ' ms':>14}" for f in formats) + "  (x float32)")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(rows, k, generator=generator) for k, _ in SHAPES}
            times: dict[str, list[float]] = {f: [] for f in formats}
            for _ in range(args.repeats + 1):  # the first round warms up
                for f in formats:
                    dtype_inputs = {k: v.to(_dtype(f)) for k, v in inputs.items()}
                    times[f].append(time_pass(passes[f], dtype_inputs, clock))
            medians = {f: statistics.median(t[1:]) * 1e3 for f, t in times.items()}
            cells = " ".join(f"{m:>14.2f}" for m in medians.values())
            base = medians.get("float32")
            ratios = " ".join(f"{m / base:.2f}" for m in medians.values()) if base else ""
            print(f"{rows:>5} {cells}  ({ratios})", flush=True)


def _dtype(fmt: str) -> torch.dtype:
    return torch.bfloat16 if fmt == "bfloat16" else torch.float32


if __name__ == "__main__":
    main()
