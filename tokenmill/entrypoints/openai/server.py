"""`tokenmill serve`: load the model, then serve the OpenAI API with uvicorn until a signal.

On SIGTERM or SIGINT uvicorn stops accepting connections and lets in-flight requests finish
for `--shutdown-timeout` seconds; then it cancels the rest, whose streams abort their engine
requests, and the lifespan hook stops the engine thread.
"""

from __future__ import annotations

import argparse
import logging
from types import FrameType

import uvicorn
from prometheus_client import CollectorRegistry, ProcessCollector

from tokenmill.demo import DEMO_TARGET_NAME
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.dashboard.slo import parse_slo
from tokenmill.entrypoints.default_model import with_default_models
from tokenmill.entrypoints.engine_args import engine_config_from_args
from tokenmill.entrypoints.openai.api_server import build_app
from tokenmill.entrypoints.openai.context import ServerContext
from tokenmill.metrics.prometheus import EngineMetrics

logger = logging.getLogger("tokenmill.server")


def run_server(args: argparse.Namespace) -> int:
    slos = parse_slo(args.slo)
    engine = LLMEngine(with_default_models(engine_config_from_args(args)))
    model_names = args.served_model_name or [args.model or DEMO_TARGET_NAME]
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    async_engine = AsyncEngine(
        engine,
        EngineMetrics(registry, model_names[0], spec_decode=engine.speculates),
        log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
    )
    ctx = ServerContext(async_engine, model_names, str(engine.model_dir), slos=slos)
    app = build_app(ctx, registry, args.api_key)
    kv = engine.kv_cache_manager
    logger.info(
        "serving model %s (%s) on http://%s:%d; max_model_len %d; KV cache %d blocks x %d "
        "tokens = %d tokens%s",
        model_names[0],
        engine.model_dir,
        args.host,
        args.port,
        engine.max_model_len,
        kv.num_blocks,
        kv.block_size,
        kv.num_blocks * kv.block_size,
        "; API key required on /v1" if args.api_key else "",
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,  # keep the CLI's logging format
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    _Server(config, ctx).run()
    return 0


class _Server(uvicorn.Server):
    """Tells the app when shutdown begins, so endless streams end instead of holding the
    graceful shutdown for its whole timeout."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext) -> None:
        super().__init__(config)
        self._ctx = ctx

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._ctx.stopping = True
        super().handle_exit(sig, frame)
