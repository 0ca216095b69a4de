"""The GPU benchmark of issue #14, in one prepared run (< 5 minutes on one H200).

    python -m benchmarks.gpu                       # CUDA, the Llama-3.2-1B-shaped model
    python -m benchmarks.gpu --device cpu --tiny   # the same steps, tiny sizes: a dry run

Prints one JSON line per figure (`{"figure": ..., ...}`), in this order:

1. correctness: greedy fp32 token ids of a small random Llama (GQA), tokenmill (the default
   attention backend for the device: Triton on CUDA; eager and with decode steps captured as
   CUDA graphs) vs transformers, 24 prompts of varied lengths, with default settings and with
   a 64-token budget and 48 KV blocks (chunks, preemption); then, on the big bf16 model, the
   Triton backend vs the portable one.
2. batch 1: a 128-token prompt, 256 new tokens; tokenmill eager, tokenmill with CUDA graphs
   (the engine used from here on) and transformers, tokens/s.
3. throughput: 256 requests x (128 prompt + 128 new), all submitted at once to tokenmill;
   transformers in static batches of 64; output tokens/s.
4. a 4096-token prompt arriving while 64 streams decode: its TTFT and the streams' inter-token
   latencies meanwhile (p50, p99, max).

The big model is a random-weight Llama shaped like Llama-3.2-1B (hidden 2048, 16 layers,
32 heads / 8 KV heads, MLP 8192, vocab 128256, tied, bf16: 2.47 GB), built once into
~/.cache/tokenmill. Prompts are random token ids; generation ignores EOS.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.bench.random_model import make_random_model

LLAMA_1B_SHAPE = dict(
    hidden_size=2048,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=8192,
    vocab_size=128256,
    tie_word_embeddings=True,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    dtype=torch.bfloat16,
)
TINY_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    tie_word_embeddings=True,
    dtype=torch.bfloat16,
)
CHECK_SHAPE = dict(  # the fp32 correctness model: small, GQA, several blocks per prompt
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=512,
)
FULL_SIZES = dict(
    batch1_new=256, requests=256, prompt=128, new=128, hf_batch=64, streams=64, long=4096
)
TINY_SIZES = dict(batch1_new=16, requests=12, prompt=32, new=8, hf_batch=4, streams=4, long=256)


def emit(figure: str, **fields: Any) -> None:
    print(json.dumps({"figure": figure, **fields}), flush=True)


def random_prompts(count: int, length: int, seed: int, vary: bool = False) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.randint(1, length) if vary else length for _ in range(count)]
    return [[rng.randrange(10, 2000) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def engine(model_dir: Path, device: str, captured: bool = False, **engine_args: Any) -> LLM:
    """A fixed KV cache (16 GiB, 64 MiB off CUDA): the transformers model shares the device,
    and an engine not yet collected must not shrink the next one's. `captured`: decode-only
    steps as CUDA graphs (`--no-enforce-eager`; on the CPU, torch.compile: minutes)."""
    kv_bytes = 16 * 1024**3 if device.startswith("cuda") else 64 * 1024**2
    return LLM(
        model=str(model_dir), device=device, kv_cache_memory=kv_bytes,
        enforce_eager=not captured, **engine_args,
    )  # fmt: skip


def tokenmill_ids(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    outputs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def free() -> None:
    """Return what the caller has just `del`eted to the device (engines and models are made
    one after another; each engine sizes its KV cache from the memory free when it starts)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_model(model_dir: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(device).eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int, device: str) -> list[list[int]]:
    """Greedy, exactly `new_tokens` each; prompts of one batch must have equal lengths."""
    input_ids = torch.tensor(prompts, device=device)
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, input_ids.shape[1] :].tolist()


def check_against_transformers(model_dir: Path, device: str) -> None:
    prompts = random_prompts(24, 80, seed=1, vary=True)
    model = hf_model(model_dir, torch.float32, device)
    expected = [hf_generate(model, [p], 32, device)[0] for p in prompts]
    del model
    free()
    settings = {
        "default": {},
        "budget64_blocks48": dict(max_num_batched_tokens=64, num_kv_blocks=48),
    }
    for name, extra in settings.items():
        # (on a CPU, capturing is torch.compile: minutes; the tests cover it there)
        for captured in (False, True) if device.startswith("cuda") else (False,):
            llm = engine(
                model_dir, device, dtype="float32", max_model_len=256, captured=captured, **extra
            )
            backend = llm.engine.attention_backend
            got = tokenmill_ids(llm, prompts, 32)
            equal = sum(g == e for g, e in zip(got, expected))
            emit(
                "greedy_fp32_vs_transformers", setting=name, backend=backend, captured=captured,
                equal=equal, total=24,
            )  # fmt: skip
            del llm
            free()


def check_backends_agree(model_dir: Path, device: str, sizes: dict) -> None:
    """bf16: the Triton kernel vs the portable backend on the big model (first differing
    token, if any: bf16 rounding may flip a near-tie)."""
    prompts = random_prompts(16, sizes["prompt"], seed=2, vary=True)
    ids = {}
    for backend in ("torch", "triton"):
        llm = engine(model_dir, device, max_model_len=1024, attention_backend=backend)
        ids[backend] = tokenmill_ids(llm, prompts, 32)
        del llm
        free()
    same = sum(a == b for a, b in zip(ids["torch"], ids["triton"]))
    emit("greedy_bf16_triton_vs_torch_backend", equal=same, total=len(prompts))


def batch1(llm: LLM, model, device: str, sizes: dict) -> None:
    prompt = random_prompts(1, sizes["prompt"], seed=3)
    new = sizes["batch1_new"]
    tokenmill_ids(llm, prompt, 8)  # warm-up (kernel compiles)
    start = time.perf_counter()
    tokenmill_ids(llm, prompt, new)
    emit("batch1_decode", engine="tokenmill", tok_s=new / (time.perf_counter() - start))
    hf_generate(model, prompt, 8, device)
    sync(device)
    start = time.perf_counter()
    hf_generate(model, prompt, new, device)
    sync(device)
    emit("batch1_decode", engine="transformers", tok_s=new / (time.perf_counter() - start))


def throughput(llm: LLM, model, device: str, sizes: dict) -> None:
    prompts = random_prompts(sizes["requests"], sizes["prompt"], seed=4)
    new, total = sizes["new"], sizes["requests"] * sizes["new"]
    start = time.perf_counter()
    tokenmill_ids(llm, prompts, new)
    emit("throughput", engine="tokenmill", out_tok_s=total / (time.perf_counter() - start))
    batch = sizes["hf_batch"]
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        hf_generate(model, prompts[i : i + batch], new, device)
    sync(device)
    seconds = time.perf_counter() - start
    emit("throughput", engine="transformers", static_batch=batch, out_tok_s=total / seconds)


def long_prompt_into_streams(llm: LLM, sizes: dict) -> None:
    core = llm.engine
    for i, prompt in enumerate(random_prompts(sizes["streams"], sizes["prompt"], seed=5)):
        core.add_request(f"s{i}", prompt, greedy(100_000))
    started: set[str] = set()
    while len(started) < sizes["streams"]:  # every stream past its prefill
        started.update(o.request_id for o in core.step() if o.outputs[0].token_ids)
    last = dict.fromkeys(started, time.perf_counter())
    gaps: list[float] = []
    arrival = time.perf_counter()
    core.add_request("long", random_prompts(1, sizes["long"], seed=6)[0], greedy(1))
    ttft = None
    while ttft is None:
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id == "long":
                ttft = now - arrival
            elif out.request_id in last:
                gaps.append(now - last[out.request_id])
                last[out.request_id] = now
    core.abort_request([f"s{i}" for i in range(sizes["streams"])])
    gaps.sort()
    emit(
        "long_prompt_into_streams",
        prompt=sizes["long"],
        streams=sizes["streams"],
        ttft_s=ttft,
        itl_p50_ms=1e3 * statistics.median(gaps),
        itl_p99_ms=1e3 * gaps[int(0.99 * (len(gaps) - 1))],
        itl_max_ms=1e3 * gaps[-1],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model and sizes (a dry run)")
    args = parser.parse_args()
    sizes = TINY_SIZES if args.tiny else FULL_SIZES
    if not args.device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton kernel on CPU tensors
    emit("environment", device=args.device, torch=torch.__version__, python=sys.version.split()[0])
    check_dir = make_random_model("bench-gqa-check-fp32-v2", CHECK_SHAPE)
    check_against_transformers(check_dir, args.device)
    shape = TINY_SHAPE if args.tiny else LLAMA_1B_SHAPE
    bench_dir = make_random_model(
        "bench-llama-3.2-1b-shaped-bf16-v2" + ("-tiny" if args.tiny else ""), shape
    )
    check_backends_agree(bench_dir, args.device, sizes)
    model = hf_model(bench_dir, torch.bfloat16, args.device)
    eager = engine(bench_dir, args.device, max_model_len=sizes["long"] + 256)
    emit("engine", captured=False)
    batch1(eager, model, args.device, sizes)  # eager, for the side-by-side
    del eager
    free()
    captured = args.device.startswith("cuda")  # compiling on a CPU takes minutes per size
    llm = engine(bench_dir, args.device, captured=captured, max_model_len=sizes["long"] + 256)
    attention = llm.engine.attention_backend
    emit("engine", attention=attention, captured=captured)
    batch1(llm, model, args.device, sizes)
    throughput(llm, model, args.device, sizes)
    del model
    free()
    long_prompt_into_streams(llm, sizes)


if __name__ == "__main__":
    main()
