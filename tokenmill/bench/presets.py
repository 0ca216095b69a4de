"""The `bench compare` presets: the comparisons each of the engine's claims rests on.

Each preset fixes a workload and the server flags that differ between its configurations;
everything else is the same for all of them. Sizes suit a small CPU (a few minutes per preset
with the built-in model); any dataset or load flag given to `bench compare` overrides them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServerConfig:
    """A server to measure: flags for a `tokenmill serve` started here, or a running one."""

    name: str
    server_args: tuple[str, ...] = ()
    url: str | None = None


@dataclass(frozen=True)
class Headline:
    """A figure a preset is about, e.g. the short requests' p99 ITL."""

    label: str
    key: str  # a `metrics_to_dict` key
    category: str | None = None  # over this dataset category's requests only
    higher_is_better: bool = False


@dataclass(frozen=True)
class Preset:
    description: str
    configs: tuple[ServerConfig, ...]
    dataset: dict[str, Any]
    load: dict[str, Any]
    server_args: tuple[str, ...] = ()
    headlines: tuple[Headline, ...] = ()


THROUGHPUT = Headline("output tok/s", "output_throughput", higher_is_better=True)

PRESETS: dict[str, Preset] = {
    "continuous-vs-static": Preset(
        "continuous batching vs the static-batching baseline: same engine and model, only "
        "--scheduling-policy differs",
        (
            ServerConfig("continuous", ("--scheduling-policy", "fcfs")),
            ServerConfig("static", ("--scheduling-policy", "static")),
        ),
        {"name": "sharegpt-like", "num_prompts": 64, "sharegpt_scale": 0.25},
        {"request_rate": math.inf},
        ("--max-num-seqs", "16"),
        (
            THROUGHPUT,
            Headline("mean TTFT (ms)", "mean_ttft_ms"),
            Headline("p95 TTFT (ms)", "p95_ttft_ms"),
            Headline("mean E2EL (ms)", "mean_e2el_ms"),
        ),
    ),
    "prefix-caching": Preset(
        "automatic prefix caching on vs off, on requests sharing a long system prompt",
        (
            ServerConfig("prefix-cache-on", ("--enable-prefix-caching",)),
            ServerConfig("prefix-cache-off", ("--no-enable-prefix-caching",)),
        ),
        {
            "name": "shared-prefix",
            "num_prompts": 48,
            "prefix_len": 768,
            "suffix_len": 32,
            "prefix_output_len": 16,
        },
        {"request_rate": math.inf, "max_concurrency": 8},
        (),
        (
            Headline("mean TTFT (ms)", "mean_ttft_ms"),
            Headline("p95 TTFT (ms)", "p95_ttft_ms"),
            Headline("req/s", "request_throughput", higher_is_better=True),
        ),
    ),
    "chunked-prefill": Preset(
        "chunked prefill on vs off with long documents among chat requests; without chunking "
        "a step must hold a whole prompt, so its token budget is the longest prompt's",
        (
            ServerConfig(
                "chunked", ("--enable-chunked-prefill", "--max-num-batched-tokens", "128")
            ),
            ServerConfig(
                "unchunked", ("--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048")
            ),
        ),
        {
            "name": "long-doc-mix",
            "num_prompts": 96,
            "random_input_len": 64,
            "random_output_len": 32,
            "random_range_ratio": 0.5,
            "long_doc_len": 1536,
            "long_doc_output_len": 8,
            # Enough long documents that the gaps they stall are over 1% of all short-request
            # gaps: a p99 can only see what happens more often than once in a hundred.
            "long_doc_fraction": 0.2,
        },
        {"request_rate": 6.0},
        ("--no-enable-prefix-caching",),
        (
            Headline("short p99 ITL (ms)", "p99_itl_ms", "short"),
            Headline("short p50 ITL (ms)", "p50_itl_ms", "short"),
            Headline("long mean TTFT (ms)", "mean_ttft_ms", "long"),
            THROUGHPUT,
        ),
    ),
}
