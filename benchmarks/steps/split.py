"""Where a decode step's time goes: outside the forward, linears, attention, everything else.

    python -m benchmarks.steps split [--model PATH] [--dtype float32] [--batch 1] [--steps 30]

Runs `--batch` requests of 128 random prompt ids into steady decoding, then times `--steps`
engine steps (wall and process CPU), the model's forward + logits inside them (the engine's
`forward_seconds`), and, with the same shapes, the step's linears alone (every linear module
called on a `[batch, in_features]` input, the LM head included) and its attention calls alone
(each layer's backend on the step's metadata, replayed). "Other" is the forward less both:
norms, RoPE, residual adds, KV writes and per-op dispatch. Prints one line per part.
Default model: the SmolLM2-135M-shaped random model (`tokenmill bench make-model --preset smollm`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.attention.base import PagedAttention


def timed(function, repeats: int) -> float:
    """Median seconds of `function()` over `repeats` calls, after one warm-up."""
    function()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if args.model is None:
        from tokenmill.bench.random_model import PRESETS

        args.model = str(PRESETS["smollm"].model_dir())
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=512)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [rng.randrange(10, 2000) for _ in range(128)], params)
    for _ in range(10):
        engine.step()
    captured: dict = {}
    original = PagedAttention.forward

    def capture(self, query, kv, kv_cache, metadata):  # the step's attention inputs
        captured.setdefault("calls", []).append((self, query, kv, kv_cache, metadata))
        return original(self, query, kv, kv_cache, metadata)

    PagedAttention.forward = capture
    engine.step()
    PagedAttention.forward = original
    forward_before = engine.get_stats().forward_seconds
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - wall) / args.steps
    cpu = (time.process_time() - cpu) / args.steps
    forward = (engine.get_stats().forward_seconds - forward_before) / args.steps
    model = engine.model
    dtype = next(model.parameters()).dtype
    linears = [
        m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")
    ]
    inputs = [torch.randn(args.batch, m.in_features).to(dtype) for m in linears]

    def run_linears() -> None:
        with torch.inference_mode():
            for module, x in zip(linears, inputs):
                module(x)

    def run_attention() -> None:
        with torch.inference_mode():
            for backend, query, kv, kv_cache, metadata in captured.get("calls", []):
                original(backend, query, kv, kv_cache, metadata)

    linear_time = timed(run_linears, args.steps)
    attention_time = timed(run_attention, args.steps)
    weight_bytes = sum(m.in_features * m.out_features for m in linears) * dtype.itemsize
    print(f"batch {args.batch} {dtype}: step {wall * 1e3:.2f} ms (CPU {cpu * 1e3:.2f} ms)")
    print(f"  outside the forward: {(wall - forward) * 1e3:.2f} ms")
    print(f"  forward + logits:    {forward * 1e3:.2f} ms")
    print(
        f"    linears:   {linear_time * 1e3:.2f} ms ({len(linears)} calls, "
        f"{weight_bytes / linear_time / 1e9:.1f} GB/s of weights)"
    )
    if model.decoder_stack is not None:  # one native call: its attention is not separable
        print("    (layers run as the fused decoder stack: attention and other not split)")
    else:
        print(f"    attention: {attention_time * 1e3:.2f} ms ({len(captured['calls'])} calls)")
        print(f"    other:     {(forward - linear_time - attention_time) * 1e3:.2f} ms")
    engine.abort_request([str(i) for i in range(args.batch)])


if __name__ == "__main__":
    main()
