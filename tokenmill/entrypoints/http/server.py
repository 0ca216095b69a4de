"""`tokenmill serve`: load the model, then serve the OpenAI API with uvicorn on the socket the
command bound first (entrypoints/http/transport/listener.py) until a signal.

On SIGTERM or SIGINT uvicorn stops accepting connections and lets in-flight requests finish
for `--shutdown-timeout` seconds; then each request still open is ended with an error (a
stream gets an error event and `[DONE]`), its engine requests aborted, and the lifespan hook
stops the engine thread. If the engine loop dies, the server shuts down the same way and the
process exits with status 1, so that a supervisor restarts it (as vLLM does). After a signal
uvicorn re-raises it; the command turns Ctrl+C's KeyboardInterrupt into exit status 130
(entrypoints/cli.py).

Connections are bounded (entrypoints/http/transport/connections.py): request headers and bodies must
arrive within their read timeouts, and at most --max-connections are open at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from types import FrameType

import uvicorn
from prometheus_client import CollectorRegistry, ProcessCollector

from tokenmill.demo import DEMO_TARGET_NAME
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.dashboard.slo import parse_slo
from tokenmill.entrypoints.default_model import with_default_models
from tokenmill.entrypoints.engine_args import engine_config_from_args
from tokenmill.entrypoints.http.app import build_app
from tokenmill.entrypoints.http.context import ServerContext
from tokenmill.entrypoints.http.lora_adapters import served_adapters
from tokenmill.entrypoints.http.pooling.server import run_pooling_server
from tokenmill.entrypoints.http.replies.reply_parsing import reply_parsing_from_args
from tokenmill.entrypoints.http.transport.api_keys import ApiKeys, api_keys_from_args
from tokenmill.entrypoints.http.transport.connections import (
    default_max_connections,
    guarded_protocol,
    rate_limit_accept_errors,
)
from tokenmill.metrics.prometheus import EngineMetrics
from tokenmill.metrics.vllm_names import VllmNames
from tokenmill.pooling.config import resolve_task

logger = logging.getLogger("tokenmill.server")

# Seconds uvicorn waits, after the grace period has ended open requests with an error, for
# their responses to finish before it cancels them.
ERROR_FLUSH_SECONDS = 2.0


def run_server(args: argparse.Namespace, listener: socket.socket) -> int:
    task = resolve_task(args.task, args.model)
    if task != "generate":  # embeddings and scores: the pooling engine and its routes
        return run_pooling_server(args, listener, task)
    slos = parse_slo(args.slo)
    reply_parsing = reply_parsing_from_args(args)  # checked before the model loads
    api_keys = api_keys_from_args(args)
    if args.responses_store_max_bytes < 1:
        raise ValueError(
            f"--responses-store-max-bytes must be >= 1, got {args.responses_store_max_bytes}"
        )
    engine = LLMEngine(with_default_models(engine_config_from_args(args)))
    model_names = args.served_model_name or [args.model or DEMO_TARGET_NAME]
    adapters = served_adapters(engine, args.lora_modules, model_names[0])
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    async_engine = AsyncEngine(
        engine,
        EngineMetrics(registry, model_names[0], spec_decode=engine.speculates),
        log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
    )
    if args.vllm_metric_names:
        VllmNames(registry)
    ctx = ServerContext(
        async_engine,
        model_names,
        str(engine.parts.model_dir),
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        slos=slos,
        reply_parsing=reply_parsing,
        adapters=adapters,
    )
    app = build_app(
        ctx,
        registry,
        api_keys,
        args.max_request_body_bytes,
        metrics_without_api_key=args.metrics_without_api_key,
        responses_store_max_bytes=args.responses_store_max_bytes,
    )
    max_connections = args.max_connections or default_max_connections()
    num_kv_blocks, block_size = engine.get_stats().scheduler.num_kv_blocks, engine.config.block_size
    logger.info(
        "serving model %s (%s) on http://%s:%d; max_model_len %d; KV cache %d blocks x %d "
        "tokens = %d tokens; at most %d connections%s",
        model_names[0],
        engine.parts.model_dir,
        args.host,
        args.port,
        engine.max_model_len,
        num_kv_blocks,
        block_size,
        num_kv_blocks * block_size,
        max_connections,
        _key_note(api_keys),
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_config=None,  # keep the CLI's logging format
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=args.shutdown_timeout + ERROR_FLUSH_SECONDS,
        timeout_keep_alive=args.timeout_keep_alive,
        http=guarded_protocol(args.header_read_timeout, args.body_read_timeout, max_connections),
    )
    server = _Server(config, async_engine, ctx, args.shutdown_timeout)
    server.run(sockets=[listener])
    return 1 if server.engine_died else 0


def _key_note(keys: ApiKeys) -> str:
    if not keys:
        return ""
    several = f" (one of {len(keys.keys)})" if len(keys.keys) > 1 else ""
    return f"; API key required{several} (docs/server.md lists the open routes)"


class _Server(uvicorn.Server):
    """uvicorn, ending open requests with an error at the end of the grace period (it would
    only cut them), shutting down when the engine loop dies, and telling the app when shutdown
    begins so endless streams (the dashboard) end instead of holding the graceful shutdown."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncEngine,
        ctx: ServerContext,
        grace_seconds: float,
    ) -> None:
        super().__init__(config)
        self.engine = engine
        self._ctx = ctx
        self.grace_seconds = grace_seconds
        self.engine_died = False
        engine.on_dead = self._on_engine_dead

    def _on_engine_dead(self, error: BaseException) -> None:
        """Runs on the engine thread (or a tensor-parallel worker's watcher); uvicorn polls
        `should_exit`."""
        logger.critical(
            "the engine loop died (%r): shutting the server down; the process exits with "
            "status 1 so a supervisor can restart it",
            error,
        )
        self.engine_died = True
        self._ctx.stopping = True
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        rate_limit_accept_errors(asyncio.get_running_loop())
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._ctx.stopping = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        cut = asyncio.get_running_loop().call_later(
            self.grace_seconds,
            self.engine.fail_open_requests,
            EngineDeadError("the server is shutting down; this request was cut short"),
        )
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()
