"""`tokenmill serve`'s own flags (the engine's come from engine_args). Light to import, so
`tokenmill --help` does not load torch."""

from __future__ import annotations

import argparse

from tokenmill.entrypoints.http.responses.store import DEFAULT_MAX_STORED_BYTES
from tokenmill.entrypoints.http.transport.api_keys import add_api_key_args
from tokenmill.entrypoints.router.balancing.policies import POLICIES
from tokenmill.entrypoints.router.launching.cli_args import add_routing_args


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use; the first is reported (default: the model argument)",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters served by name (with --enable-lora): name=path, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\'; a request\'s model field '
        "picks one (docs/lora.md)",
    )
    add_api_key_args(
        group,
        "on every route but /health, /version and /openapi.json: /v1/*, /metrics, "
        "/dashboard*, /tokenize, /detokenize, /reset_prefix_cache",
    )
    group.add_argument(
        "--metrics-without-api-key",
        action="store_true",
        help="with --api-key, still serve /metrics without it (for scrapers that cannot send "
        "a bearer token); its prefix-cache counters then tell anyone whether other clients' "
        "prompts were cached",
    )
    group.add_argument(
        "--vllm-metric-names",
        action="store_true",
        help="also export the metrics vLLM has under its `vllm:` names "
        "(vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ...) for routers and "
        "autoscalers written for vLLM (docs/scale_out.md)",
    )
    group.add_argument(
        "--shutdown-timeout",
        type=int,
        default=30,
        help="seconds in-flight requests get to finish after SIGTERM/SIGINT",
    )
    group.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details (cached_tokens); off by default, as in vLLM, "
        "since a client can learn from it whether another's prompt was cached",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=2 * 1024 * 1024,
        help="refuse request bodies larger than this with 413 (default: 2 MiB)",
    )
    group.add_argument(
        "--responses-store-max-bytes",
        type=int,
        default=DEFAULT_MAX_STORED_BYTES,
        help="the most memory the Responses API's stored responses (`store: true`) may take, "
        "in bytes; the oldest are evicted first (default: 256 MiB)",
    )
    _add_connection_args(group)
    group.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line")
    group.add_argument(
        "--log-stats-interval", type=float, default=5.0, help="seconds between stats lines"
    )
    group.add_argument(
        "--slo",
        default=None,
        help="latency targets for the dashboard's goodput, e.g. ttft=500ms,tpot=50ms "
        "(ttft, tpot, e2el; a bare number is milliseconds)",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level",
    )
    group.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request"
    )
    _add_reply_parsing_args(parser)
    _add_data_parallel_args(parser)


def _add_connection_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--header-read-timeout",
        type=_positive_seconds,
        default=10.0,
        help="seconds a connection gets to send a request's headers (from its start, or from "
        "the first byte of its next request); then it is closed",
    )
    group.add_argument(
        "--body-read-timeout",
        type=_positive_seconds,
        default=30.0,
        help="seconds a request gets to send its body once its headers are in; then its "
        "connection is closed",
    )
    group.add_argument(
        "--timeout-keep-alive",
        type=_positive_seconds,
        default=5.0,
        help="seconds an idle kept-alive connection stays open (uvicorn's, as in vLLM)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at most; a connection beyond them is answered 503 and closed "
        "(default: the file descriptor limit, raised to its hard limit, less 128)",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def _add_reply_parsing_args(parser: argparse.ArgumentParser) -> None:
    # Parser names as vLLM's; kept here (not imported) so `--help` stays light. The server
    # checks them at start-up against the registries.
    group = parser.add_argument_group("tool calling and reasoning (docs/server.md)")
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto": the model\'s calls are read out of its reply by '
        "--tool-call-parser",
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json", "mistral", "pythonic", "openai"],
        help="how the model writes tool calls (hermes: Qwen2.5/Qwen3 and the demo models; "
        "openai: gpt-oss's harmony)",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["deepseek_r1", "qwen3", "openai_gptoss"],
        help="split <think>...</think> (openai_gptoss: harmony's analysis channel) off replies "
        "into reasoning_content",
    )


def _add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    parallel = parser.add_argument_group("data parallel (docs/scale_out.md)")
    parallel.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas (processes, each on a private port) behind one router on --port",
    )
    parallel.add_argument(
        "--data-parallel-backend",
        default="mp",
        choices=["mp", "ray"],
        help="where the replicas run: mp, processes of this machine on loopback ports; ray, "
        "each held by a Ray actor on the node a placement group gives it, served at that "
        "node's address (vLLM's flag; docs/scale_out.md)",
    )
    parallel.add_argument(
        "--routing-policy",
        default="prefix-aware",
        choices=POLICIES,
        help="how the router picks a replica, with --data-parallel-size > 1",
    )
    parallel.add_argument(
        "--disaggregate",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="prefill/decode disaggregation on this machine: a prefill instance and a decode "
        "instance, each pinned to its own half of the CPUs, the KV moved between them by the "
        "P2P connector, behind a router on --port",
    )
    add_routing_args(parallel)
