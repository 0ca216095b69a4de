"""Quantized linear layers vs float ones, on the shapes of SmolLM2-135M (hidden 576, 9 / 3
heads of 64, MLP 1536, 30 layers: 120 products per token).

    python benchmarks/quantized_linear.py [--repeats 5] [--e2e] [--e2e-tokens 32]

Micro: one token's (and 16 tokens') 120 products through 30 copies of each layer (so the
weights stream from memory as in a model, not from cache), for float32 (oneDNN, the engine's
CPU default), bfloat16 (F.linear), int8 (per channel) and int4 (groups of 32); interleaved
repeats, medians, each format's time as a ratio to float32. With --e2e, offline generation
with the random SmolLM2-shaped model (benchmarks/make_smollm_shaped_model.py) at batch 1 and
16 (128-token prompts, --e2e-tokens generated, greedy): output tokens/s of --quantization
int8 / int4 against the default, interleaved.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from tokenmill.layers.int4_linear import Int4LinearMethod
from tokenmill.layers.int8_linear import Int8LinearMethod
from tokenmill.layers.linear import DenseLinearMethod, Linear, LinearMethod, OneDNNLinearMethod

# (in, out) of qkv, o, gate_up, down in SmolLM2-135M.
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
NUM_LAYERS = 30
FORMATS: dict[str, tuple[torch.dtype, Callable[[], LinearMethod]]] = {
    "float32": (torch.float32, OneDNNLinearMethod),
    "bfloat16": (torch.bfloat16, lambda: DenseLinearMethod(torch.bfloat16)),
    "int8": (torch.bfloat16, Int8LinearMethod),
    "int4-g32": (torch.bfloat16, lambda: Int4LinearMethod(32)),
}


def build(fmt: str) -> list[Linear]:
    dtype, method = FORMATS[fmt]
    layers = []
    for _ in range(NUM_LAYERS):
        for in_features, out_features in SHAPES:
            linear = nn.Linear(in_features, out_features, bias=False).to(dtype)
            layer = Linear.from_module(linear, method())
            if not layer.quant_method.holds_float_weight:
                layer.quant_method.load_weight(layer, linear.weight.detach().float(), 0)
            layer.quant_method.process_weights_after_loading(layer)
            layers.append(layer)
    return layers


def time_products(layers: list[Linear], rows: int, dtype: torch.dtype) -> float:
    inputs = {n: torch.randn(rows, n, dtype=dtype) for n, _ in SHAPES}
    start = time.perf_counter()
    for layer in layers:
        layer(inputs[layer.in_features])
    return time.perf_counter() - start


def micro(repeats: int) -> None:
    models = {fmt: build(fmt) for fmt in FORMATS}
    print(f"{'rows':>4} " + " ".join(f"{fmt + ' ms':>12}" for fmt in FORMATS) + "  (x float32)")
    with torch.inference_mode():
        for rows in (1, 16):
            times: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
            for _ in range(repeats + 1):  # the first round warms up
                for fmt, layers in models.items():
                    times[fmt].append(time_products(layers, rows, FORMATS[fmt][0]))
            medians = {fmt: statistics.median(t[1:]) * 1e3 for fmt, t in times.items()}
            cells = " ".join(f"{m:>12.2f}" for m in medians.values())
            ratios = " ".join(f"{medians[f] / medians['float32']:.2f}" for f in FORMATS)
            print(f"{rows:>4} {cells}  ({ratios})", flush=True)


def e2e(repeats: int, max_tokens: int, batches: tuple[int, ...]) -> None:
    from make_smollm_shaped_model import model_dir

    from tokenmill import LLM, SamplingParams

    model = str(model_dir())
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rng = random.Random(0)
    settings = {"default": None, "int8": "int8", "int4": "int4"}
    print(f"{'batch':>5} " + " ".join(f"{s + ' tok/s':>14}" for s in settings) + "  (x default)")
    for batch in batches:
        engines = {
            name: LLM(
                model=model,
                max_num_seqs=batch,
                quantization=q,
                max_model_len=512,
                kv_cache_memory=2**28,
            )
            for name, q in settings.items()
        }
        prompts = [[rng.randrange(10, 2000) for _ in range(128)] for _ in range(batch)]
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(repeats):
            for name, llm in engines.items():
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                rates[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
        medians = {name: statistics.median(r) for name, r in rates.items()}
        cells = " ".join(f"{m:>14.1f}" for m in medians.values())
        ratios = " ".join(f"{medians[n] / medians['default']:.2f}" for n in settings)
        print(f"{batch:>5} {cells}  ({ratios})", flush=True)
        del engines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--e2e", action="store_true", help="also offline generation")
    parser.add_argument("--e2e-tokens", type=int, default=32)
    parser.add_argument("--no-micro", action="store_true", help="skip the per-layer products")
    parser.add_argument("--batches", default="1,16", help="e2e batch sizes")
    args = parser.parse_args()
    if not args.no_micro:
        micro(args.repeats)
    if args.e2e:
        batches = tuple(int(b) for b in args.batches.split(","))
        e2e(max(args.repeats // 2, 1), args.e2e_tokens, batches)


if __name__ == "__main__":
    main()
