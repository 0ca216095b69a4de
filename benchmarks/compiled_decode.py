"""Eager vs compiled decode steps of the SmolLM2-135M-shaped model, side by side.

    OMP_NUM_THREADS=1 python benchmarks/compiled_decode.py --batches 1,16,64 --reps 7 [--regional]

Loads the model twice (oneDNN-reordered linears, as eager steps run by default, and plain
`nn.Linear`, which the compiled step needs), compiles the plain one's forward with static
shapes and freezing (what `--no-enforce-eager` does on the CPU), then times one decode step
(forward + logits; contexts of 200 tokens) of each, interleaved, and prints one JSON line per
batch size: compile time (wall and process CPU) and median wall and CPU ms per step. CPU time
is the figure a shared machine's load disturbs least. `--regional` adds a fourth: one decoder
layer compiled (static shapes, no freezing) and reused by all of them (regional compilation:
seconds instead of minutes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from make_smollm_shaped_model import model_dir
from transformers import AutoConfig

from tokenmill.layers.kv_cache import KVCacheSpec
from tokenmill.models.loader import LoadSettings, load_model
from tokenmill.step.layout import layout_step
from tokenmill.worker.capture_backends import compile_forward

CONTEXT = 200
BLOCK = 16


def compile_layers(model: torch.nn.Module) -> torch.nn.Module:
    """Each decoder layer compiled in place; they share one code object, so dynamo compiles
    its graph once and every layer reuses it (torch's recipe for repeated blocks)."""
    for layer in model.layers:
        layer.compile(dynamic=False)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--regional", action="store_true", help="also one compiled layer")
    args = parser.parse_args()
    path = model_dir()
    config = AutoConfig.from_pretrained(path)
    cpu = torch.device("cpu")
    load = lambda backend: load_model(  # noqa: E731
        path, LoadSettings(torch.float32, linear_backend=backend), cpu
    )
    models = {"eager_onednn": load("auto"), "eager_plain": load("torch")}
    blocks_per_seq = -(-CONTEXT // BLOCK)
    batches = [int(b) for b in args.batches.split(",")]
    spec = KVCacheSpec(
        config.num_hidden_layers, BLOCK, config.num_key_value_heads, 64, torch.float32
    )
    kv_caches = spec.allocate(max(batches) * blocks_per_seq, cpu)
    plain = models["eager_plain"]
    compiled = compile_forward(lambda *a: plain(*a), max_keys=len(batches))
    forwards = {name: m.forward for name, m in models.items()} | {"compiled": compiled}
    if args.regional:
        forwards["regional"] = compile_layers(load("torch")).forward
    for batch in batches:
        block_ids = [
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(batch)
        ]
        query_lens = np.ones(batch, dtype=np.int64)
        positions, metadata = layout_step(
            block_ids, query_lens, np.full(batch, CONTEXT), BLOCK, None, cpu
        )
        step = (torch.randint(0, 2000, (batch,)), torch.from_numpy(positions), kv_caches, metadata)
        with torch.inference_mode():
            wall, cpu_time = time.perf_counter(), time.process_time()
            compiled(*step)
            compile_s = (time.perf_counter() - wall, time.process_time() - cpu_time)
            if args.regional:
                wall, cpu_time = time.perf_counter(), time.process_time()
                forwards["regional"](*step)
                regional_s = (time.perf_counter() - wall, time.process_time() - cpu_time)
            times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in forwards}
            for _ in range(args.reps):
                for name, forward in forwards.items():
                    wall, cpu_time = time.perf_counter(), time.process_time()
                    plain.compute_logits(forward(*step))
                    times[name][0].append(time.perf_counter() - wall)
                    times[name][1].append(time.process_time() - cpu_time)
        result = {
            name: {
                "wall_ms": round(statistics.median(w) * 1e3, 1),
                "cpu_ms": round(statistics.median(c) * 1e3, 1),
            }
            for name, (w, c) in times.items()
        }
        print(
            json.dumps(
                {
                    "batch": batch,
                    "compile_wall_s": round(compile_s[0], 1),
                    "compile_cpu_s": round(compile_s[1], 1),
                    **(
                        {"regional_compile_cpu_s": round(regional_s[1], 1)} if args.regional else {}
                    ),
                    **result,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
