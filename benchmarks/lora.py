"""Multi-LoRA throughput: 8 adapters mixed across concurrent requests vs the base model alone,
and the time to load an adapter.

    python -m benchmarks.lora [--preset smollm | 1b | --model PATH] [--adapters 8]
                              [--requests 64] [--tokens 32] [--rounds 3] [--rank 16]
                              [--dtype auto | float32 | bfloat16] [--with-modules]
                              [--no-base-engine]

With no model: a preset's random checkpoint (`tokenmill bench make-model --preset ...`):
`smollm` (SmolLM2-135M's shape, the default) or `1b` (Llama-3.2-1B's: hidden 2048, 16
layers). `--dtype auto` is the engine's choice (bfloat16 on a CPU with AVX512_BF16 or AMX,
float32 below), and the header names what it resolved to. `--no-base-engine` leaves out the
engine without --enable-lora (the base then runs on the LoRA engine alone): one engine's
memory, for the 1B shape in float32 (5 GB each) on a small machine.

Random peft adapters (every decoder target, --rank) are written to a temporary directory. Per
round, in a shuffled order: all requests on the base model through an engine without --enable-lora,
the same through the LoRA engine, and the requests spread evenly over the adapters on the LoRA
engine (--max-loras = --adapters); with --with-modules also the mixed requests through the layer
modules (the fused stack set aside: the path adapter steps took before the stack applied them).
Output tokens/s, median over rounds, and CPU time per output token (the work, which others' load on
a shared machine disturbs less).
Adapter load time: reading and checking each adapter into a fresh store (median).
With --split, where each case's time went: the fused stack's forward (the decoder layers, the
adapters' products inside it) per full decode step (median) and in all, against the wall time
(the rest: embedding, logits, sampling, scheduling, the adapters' slot mapping).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.bench.random_model import PRESETS
from tokenmill.lora.adapter_store import LoRAAdapterStore


def make_adapters(model: Path, count: int, rank: int, root: Path) -> list[LoRARequest]:
    """Random adapters under `root`, reusing those already there (each writes by loading the
    base in float32 through transformers: seconds a piece for the 1B shape)."""
    from tokenmill_testing.lora_adapters import save_random_adapter

    requests = []
    for i in range(count):
        path = root / f"a{i}"
        if not (path / "adapter_config.json").is_file():
            save_random_adapter(model, path, rank=rank, seed=i)
        requests.append(LoRARequest(f"a{i}", i + 1, str(path)))
    return requests


class StackTimer:
    """The native stack with each `forward`'s rows and seconds recorded."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, []

    def forward(self, hidden: Any, *args: Any) -> Any:
        start = time.perf_counter()
        out = self.inner.forward(hidden, *args)
        self.calls.append((hidden.shape[0], time.perf_counter() - start))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def run(
    llm: LLM,
    prompts: list[list[int]],
    loras: list[LoRARequest | None],
    tokens: int,
    stack: bool = True,
) -> tuple[float, float]:
    """Output tokens/s, and CPU seconds (every thread of the process) per output token: on a
    shared machine the second counts the work done, not the time others took."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    model = llm.engine.runner.model
    fused = model.decoder_stack
    model.decoder_stack = fused if stack else None
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    finally:
        model.decoder_stack = fused
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens_out / elapsed, cpu / tokens_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--preset", default="smollm", choices=sorted(PRESETS))
    parser.add_argument("--no-base-engine", action="store_true")
    parser.add_argument(
        "--adapter-dir",
        type=Path,
        default=None,
        help="keep the random adapters here and reuse them (default: a temporary directory)",
    )
    parser.add_argument(
        "--prepare", action="store_true", help="only write the adapters (--adapter-dir), then exit"
    )
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--with-modules", action="store_true")
    parser.add_argument("--split", action="store_true", help="time the stack's forward per case")
    args = parser.parse_args()
    model = args.model or PRESETS[args.preset].model_dir()
    settings = {"dtype": args.dtype, "max_model_len": 512, "max_num_seqs": args.requests}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(model, args.adapters, args.rank, args.adapter_dir or Path(tmp))
        if args.prepare:
            return
        lora_llm = LLM(
            model=str(model),
            enable_lora=True,
            max_loras=args.adapters,
            max_lora_rank=args.rank,
            **settings,
        )
        base_llm = None if args.no_base_engine else LLM(model=str(model), **settings)
        embed = getattr(lora_llm.engine.runner.model, "embed_tokens", None)
        dtype = str(getattr(getattr(embed, "weight", None), "dtype", args.dtype))
        store = LoRAAdapterStore(lora_llm.engine.parts.lora_store.base, args.rank, args.adapters)
        for adapter in adapters:
            store.get(adapter)
        rng = random.Random(0)
        prompts = [
            [rng.randrange(3, 2000) for _ in range(args.prompt_tokens)]
            for _ in range(args.requests)
        ]
        mixed = [adapters[i % len(adapters)] for i in range(args.requests)]
        cases: dict[str, tuple[LLM, list[LoRARequest | None], bool]] = {}
        if base_llm is not None:
            cases["base, no --enable-lora"] = (base_llm, [None] * args.requests, True)
        cases["base, LoRA engine"] = (lora_llm, [None] * args.requests, True)
        cases[f"{args.adapters} adapters mixed"] = (lora_llm, mixed, True)
        if args.with_modules:
            cases[f"{args.adapters} adapters, modules"] = (lora_llm, mixed, False)
        for llm, loras, stack in cases.values():  # warm-up: kernels, slots, caches
            run(llm, prompts[:8], loras[:8], 4, stack)
        results: dict[str, list[float]] = {name: [] for name in cases}
        cpu: dict[str, list[float]] = {name: [] for name in cases}
        splits: dict[str, list[tuple[float, float, float]]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name in rng.sample(list(cases), len(cases)):
                llm, loras, stack = cases[name]
                llm.reset_prefix_cache()
                fused = llm.engine.runner.model.decoder_stack
                timer = StackTimer(fused.native) if args.split and stack else None
                if timer is not None:
                    fused.native = timer
                start = time.perf_counter()
                try:
                    speed, cpu_per_token = run(llm, prompts, loras, args.tokens, stack)
                finally:
                    if timer is not None:
                        fused.native = timer.inner
                wall = time.perf_counter() - start
                results[name].append(round(speed, 1))
                cpu[name].append(cpu_per_token)
                if timer is not None:
                    decode = [s for rows, s in timer.calls if rows == args.requests]
                    forward = sum(s for _, s in timer.calls)
                    splits[name].append((statistics.median(decode or [0.0]), forward, wall))
    print(
        f"{model.name}, {dtype.removeprefix('torch.')} (--dtype {args.dtype}), {args.requests} "
        f"requests x {args.prompt_tokens} prompt + {args.tokens} output tokens, rank {args.rank}, "
        f"{args.rounds} rounds"
    )
    base = next(iter(cases))  # the engine without --enable-lora, else the LoRA engine's base
    baseline, cpu_baseline = statistics.median(results[base]), statistics.median(cpu[base])
    for name, values in results.items():
        median, cpu_ms = statistics.median(values), statistics.median(cpu[name])
        print(
            f"  {name:28s} {median:8.1f} output tok/s  ({median / baseline:.2f}x)  {values}; "
            f"CPU {cpu_ms * 1e3:.2f} ms/token ({cpu_baseline / cpu_ms:.2f}x)"
        )
    for name, values in splits.items():
        if values:
            step, forward, wall = (statistics.median(v) for v in zip(*values))
            print(
                f"  {name:28s} stack forward: decode step {step * 1e3:.1f} ms, "
                f"{forward:.2f} s of {wall:.2f} s wall ({forward / wall:.0%})"
            )
    loads = store.load_seconds
    print(
        f"  adapter load (read + check): median {statistics.median(loads) * 1e3:.1f} ms "
        f"over {len(loads)}"
    )


if __name__ == "__main__":
    main()
