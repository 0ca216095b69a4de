"""`tokenmill serve` for a pooling model (`--task embed|score`, or `auto` from the
checkpoint): the pooling engine on its thread behind the pooling app, with uvicorn on the
socket the command bound first. The generative server's flags that concern generation
(tool parsers, speculation, the dashboard) do not apply and are ignored."""

from __future__ import annotations

import argparse
import logging
import socket

import uvicorn
from prometheus_client import CollectorRegistry, ProcessCollector

from tokenmill.entrypoints.engine_args import engine_config_from_args
from tokenmill.entrypoints.http.pooling.app import build_pooling_app
from tokenmill.entrypoints.http.pooling.serving import PoolingServerContext
from tokenmill.entrypoints.http.transport.api_keys import api_keys_from_args
from tokenmill.entrypoints.http.transport.connections import (
    default_max_connections,
    guarded_protocol,
)
from tokenmill.metrics.pooling import PoolingMetrics
from tokenmill.pooling.async_engine import AsyncPoolingEngine
from tokenmill.pooling.service import build_pooling_service

logger = logging.getLogger("tokenmill.server")


def run_pooling_server(args: argparse.Namespace, listener: socket.socket, task: str) -> int:
    api_keys = api_keys_from_args(args)
    service = build_pooling_service(engine_config_from_args(args), task)
    model_names = args.served_model_name or [args.model]
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    engine = AsyncPoolingEngine(service, PoolingMetrics(registry, model_names[0]))
    ctx = PoolingServerContext(engine, model_names, str(service.model_dir))
    app = build_pooling_app(
        ctx,
        registry,
        api_keys,
        args.max_request_body_bytes,
        metrics_without_api_key=args.metrics_without_api_key,
    )
    max_connections = args.max_connections or default_max_connections()
    logger.info(
        "serving pooling model %s (%s, task %s) on http://%s:%d; max_model_len %d",
        model_names[0],
        service.model_dir,
        task,
        args.host,
        args.port,
        service.max_model_len,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=args.shutdown_timeout,
        timeout_keep_alive=args.timeout_keep_alive,
        http=guarded_protocol(args.header_read_timeout, args.body_read_timeout, max_connections),
    )
    server = uvicorn.Server(config)
    server.run(sockets=[listener])
    return 0
