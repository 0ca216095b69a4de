"""Engine flags for every command, named as vLLM names them, mapped onto `EngineConfig`."""

from __future__ import annotations

import argparse

from tokenmill.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model", default=None, help="local Hugging Face model directory (default: built-in)"
    )
    group.add_argument("--tokenizer", default=None, help="tokenizer directory (default: model's)")
    group.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
        help="compute dtype; auto takes the checkpoint's unless this CPU can't run it fast",
    )
    group.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    group.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
    group.add_argument(
        "--linear-backend",
        default="auto",
        choices=["auto", "torch"],
        help="auto: linear weights reordered for oneDNN on the CPU in float32; torch: F.linear",
    )
    group.add_argument(
        "--generation-config",
        default="auto",
        help="default sampling parameters: auto = the model's generation_config.json, "
        "vllm = none (temperature 1.0), or a directory with a generation_config.json",
    )
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks")
    group.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="on CUDA: fraction of device memory the engine may use",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
        help="KV cache storage: auto = the model's dtype; fp8 halves a 16-bit cache",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of prompt prefixes seen before (on by default)",
    )
    group.add_argument(
        "--preemption-mode",
        default="recompute",
        choices=["recompute", "swap"],
        help="when KV blocks run out: recompute the victim later, or swap its KV to host memory",
    )
    group.add_argument(
        "--swap-space", type=float, default=4.0, help="GiB of host memory for swapped-out KV"
    )
    group.add_argument("--max-model-len", type=int, default=None, help="longest sequence")
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="token budget of one step"
    )
    group.add_argument("--max-num-seqs", type=int, default=256, help="most requests in a step")
    group.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts across steps",
    )
    group.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority", "static"],
        help="fcfs: continuous batching; priority: by request priority (lower first); "
        "static: the run-each-batch-to-the-end baseline",
    )
    group.add_argument(
        "--itl-target-ms",
        type=float,
        default=None,
        help="inter-token-latency target: give each step only the prompt tokens predicted to "
        "fit it after the running decodes (a cost model learned from measured steps); off "
        "by default",
    )
    group.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="at most this many prompt tokens per request and step (0: no cap)",
    )
    group.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=1,
        help="at most this many prompts cut mid-way in one step",
    )
    group.add_argument(
        "--speculative-config",
        default=None,
        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "draft_model", "model": PATH}\'',
    )
    group.add_argument("--tensor-parallel-size", type=int, default=1)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = EngineConfig.field_names()
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})
