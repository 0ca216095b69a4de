"""Running the router: uvicorn on an already bound socket, in front of `backends`."""

from __future__ import annotations

import argparse
import logging
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from fastapi import FastAPI

from tokenmill.entrypoints.http.transport.api_keys import api_keys_from_args
from tokenmill.entrypoints.router.app import build_router_app
from tokenmill.entrypoints.router.balancing.policies import Policy, make_policy
from tokenmill.entrypoints.router.balancing.replicas import ReplicaSet
from tokenmill.entrypoints.router.disaggregation.app import build_disagg_app

logger = logging.getLogger("tokenmill.router")


def run_router(
    args: argparse.Namespace,
    listener: socket.socket,
    backends: list[str],
    policy: str,
    on_exit: Callable[[], None] | None = None,
    graceful_timeout: float | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT. `on_exit` runs when the signal arrives, before uvicorn
    stops accepting (`serve --data-parallel-size`: the replicas start draining); in-flight
    requests then get `graceful_timeout` seconds (default `--shutdown-timeout`) to end."""
    app = _app(args, backends, policy)
    if graceful_timeout is None:
        graceful_timeout = getattr(args, "shutdown_timeout", 30)
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=getattr(args, "uvicorn_log_level", "info"),
        access_log=not getattr(args, "disable_uvicorn_access_log", False),
        timeout_graceful_shutdown=graceful_timeout,
    )
    _RouterServer(config, on_exit).run(sockets=[listener])


def _app(args: argparse.Namespace, backends: list[str], policy: str) -> FastAPI:
    """The router's app: over `backends`, or over prefill and decode instances."""

    def make() -> Policy:
        return make_policy(policy, args.balance_abs_threshold, args.balance_rel_threshold)

    options = {
        "api_key": api_keys_from_args(args),
        "max_body_bytes": args.max_request_body_bytes,
        "metrics_without_api_key": getattr(args, "metrics_without_api_key", False),
    }
    interval = args.health_check_interval
    prefill, decode = getattr(args, "prefill", None), getattr(args, "decode", None)
    if prefill and decode:
        logger.info(
            "routing http://%s:%d to prefill instances %s and decode instances %s (%s)",
            args.host, args.port, ", ".join(prefill), ", ".join(decode), policy,
        )  # fmt: skip
        sets = ReplicaSet(prefill, interval=interval), ReplicaSet(decode, interval=interval)
        return build_disagg_app(*sets, (make(), make()), args.prefix_chars, **options)
    logger.info(
        "routing http://%s:%d to %d replicas (%s): %s",
        args.host, args.port, len(backends), policy, ", ".join(backends),
    )  # fmt: skip
    replicas = ReplicaSet(backends, interval=interval)
    return build_router_app(replicas, make(), args.prefix_chars, **options)


class _RouterServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None] | None) -> None:
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.on_exit is not None and not self.should_exit:
            self.on_exit()
        super().handle_exit(sig, frame)
