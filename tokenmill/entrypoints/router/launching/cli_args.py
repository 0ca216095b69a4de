"""Flags of `tokenmill router`, and the routing flags `tokenmill serve --data-parallel-size`
shares with it. Light to import (no torch)."""

from __future__ import annotations

import argparse

from tokenmill.entrypoints.http.transport.api_keys import add_api_key_args
from tokenmill.entrypoints.router.balancing.policies import (
    DEFAULT_BALANCE_ABS_THRESHOLD,
    DEFAULT_BALANCE_REL_THRESHOLD,
    POLICIES,
)
from tokenmill.entrypoints.router.balancing.prefix_key import DEFAULT_PREFIX_CHARS


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """`tokenmill router`'s own flags."""
    group = parser.add_argument_group("router")
    group.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        help="a replica's base URL, e.g. http://10.0.0.2:8000 (repeat for each replica)",
    )
    group.add_argument(
        "--prefill",
        action="append",
        metavar="URL",
        help="prefill/decode disaggregation: a prefill instance's base URL (a `tokenmill "
        "serve` with a kv_producer --kv-transfer-config; repeat for each); needs --decode",
    )
    group.add_argument(
        "--decode",
        action="append",
        metavar="URL",
        help="a decode instance's base URL (a kv_consumer); repeat for each",
    )
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument("--policy", default="prefix-aware", choices=POLICIES, help="routing policy")
    add_api_key_args(
        group,
        "on the routes a server keys (all but /health, /version and /openapi.json), "
        "checked before a body is read; give the replicas' keys (the router sends the first "
        "on its own requests; a client's own key is passed on)",
    )
    group.add_argument(
        "--metrics-without-api-key",
        action="store_true",
        help="with --api-key, still serve the router's /metrics without it (it carries every "
        "replica's prefix-cache counters)",
    )
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=2 * 1024 * 1024,
        help="refuse request bodies larger than this with 413 before reading them on "
        "(default: 2 MiB)",
    )
    add_routing_args(group)


def add_routing_args(group: argparse._ArgumentGroup) -> None:
    """What both the router and `serve --data-parallel-size` take."""
    group.add_argument(
        "--prefix-chars",
        type=int,
        default=DEFAULT_PREFIX_CHARS,
        help="prefix-aware: how many characters of the prompt are hashed",
    )
    group.add_argument(
        "--balance-abs-threshold",
        type=float,
        default=DEFAULT_BALANCE_ABS_THRESHOLD,
        help="prefix-aware: a replica is overloaded (the request spills to the least loaded) "
        "when it holds this many more requests than the least loaded...",
    )
    group.add_argument(
        "--balance-rel-threshold",
        type=float,
        default=DEFAULT_BALANCE_REL_THRESHOLD,
        help="...and more than this many times as many",
    )
    group.add_argument(
        "--health-check-interval",
        type=float,
        default=1.0,
        help="seconds between health checks (and /metrics scrapes) of each replica",
    )
