"""Running the router: uvicorn on an already bound socket, in front of `backends`."""

from __future__ import annotations

import argparse
import logging
import socket

import uvicorn

from tokenmill.entrypoints.router.app import build_router_app
from tokenmill.entrypoints.router.policies import make_policy
from tokenmill.entrypoints.router.replicas import ReplicaSet

logger = logging.getLogger("tokenmill.router")


def run_router(
    args: argparse.Namespace, listener: socket.socket, backends: list[str], policy: str
) -> None:
    replicas = ReplicaSet(
        backends, interval=args.health_check_interval, api_key=getattr(args, "api_key", None)
    )
    app = build_router_app(
        replicas,
        make_policy(policy, args.balance_abs_threshold, args.balance_rel_threshold),
        args.prefix_chars,
    )
    logger.info(
        "routing http://%s:%d to %d replicas (%s): %s",
        args.host,
        args.port,
        len(backends),
        policy,
        ", ".join(backends),
    )
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=getattr(args, "uvicorn_log_level", "info"),
        access_log=not getattr(args, "disable_uvicorn_access_log", False),
        timeout_graceful_shutdown=getattr(args, "shutdown_timeout", 30),
    )
    uvicorn.Server(config).run(sockets=[listener])
