"""Structured outputs in the server, in-process: a compile slower than its timeout is a 400
before any output, a schema's check runs off the tokenizer thread every request shares, and a
request gone while its grammar queues cancels the compile."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.http.app import build_app
from tokenmill.entrypoints.http.context import ServerContext
from tokenmill.entrypoints.http.replies.structured_outputs import prepare
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.structured_output import backend
from tokenmill.structured_output.manager import StructuredOutputManager

MESSAGES = [{"role": "user", "content": "Hello"}]


def serve(model_dir: Path, **structured: Any) -> Callable[[], Any]:
    """An async context giving a client of an in-process server with these settings."""
    config = EngineConfig(
        model=str(model_dir), max_model_len=128, structured_outputs_config=structured
    )
    engine = LLMEngine(config)

    class Served:
        async def __aenter__(self) -> httpx.AsyncClient:
            self.async_engine = AsyncEngine(engine, log_stats_interval=None)
            app = build_app(
                ServerContext(self.async_engine, ["m"], "here"), CollectorRegistry(), None
            )
            self.async_engine.start()
            transport = httpx.ASGITransport(app=app)
            self.client = httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60)
            return self.client

        async def __aexit__(self, *exc_info: object) -> None:
            await self.client.aclose()
            self.async_engine.shutdown()

    return Served


def test_a_compile_past_its_timeout_is_a_400(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the request waited in the queue for as long as the compile took (a 1.8 MB
    schema: 140 s) and nothing told the client why."""
    release = threading.Event()
    real = StructuredOutputManager._compile

    def slow_compile(self, params: StructuredOutputsParams) -> Any:
        if params.regex == "slow":
            release.wait(30)
        return real(self, params)

    monkeypatch.setattr(StructuredOutputManager, "_compile", slow_compile)
    served = serve(model_dir, compile_timeout=0.3)

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with served() as client:
            body = {"messages": MESSAGES, "max_tokens": 4}
            slow = await client.post("/v1/chat/completions", json={**body, "guided_regex": "slow"})
            release.set()
            fast = await client.post("/v1/chat/completions", json={**body, "guided_regex": "[ab]+"})
            return slow, fast

    slow, fast = asyncio.run(main())
    assert slow.status_code == 400, slow.text
    error = slow.json()["error"]
    assert error["param"] == "guided_regex" and "did not compile within 0.3 s" in error["message"]
    assert fast.status_code == 200, fast.text


def test_schema_checks_run_off_the_tokenizer_thread(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A schema check that cannot finish until a /tokenize call, sent while it runs, has been
    answered: on the shared tokenizer thread (before), /tokenize queued behind it and the
    check gave up waiting; on its own thread, /tokenize answers at once."""
    checking, tokenized = threading.Event(), threading.Event()
    check_saw_tokenize: list[bool] = []
    real_check = backend._check

    def slow_check(params: StructuredOutputsParams) -> None:
        checking.set()
        check_saw_tokenize.append(tokenized.wait(20))
        real_check(params)

    monkeypatch.setattr(backend, "_check", slow_check)
    served = serve(model_dir)

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with served() as client:
            schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
            body = {"messages": MESSAGES, "max_tokens": 4, "guided_json": schema}
            constrained = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            assert await asyncio.to_thread(checking.wait, 20)
            tokenize = await client.post("/tokenize", json={"prompt": "Hello"})
            tokenized.set()
            return tokenize, await constrained

    tokenize, constrained = asyncio.run(main())
    assert tokenize.status_code == 200 and constrained.status_code == 200, constrained.text
    assert check_saw_tokenize == [True]


def test_a_request_gone_while_its_grammar_queues_cancels_the_compile(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's wait for a compile, cancelled (the client left): nobody else waits for
    that compile, so it never runs and leaves the cache (before, it ran to the end)."""
    started, release = threading.Event(), threading.Event()
    real = StructuredOutputManager._compile

    def blocking_compile(self, params: StructuredOutputsParams) -> Any:
        if params.regex == "slow":
            started.set()
            release.wait(30)
        return real(self, params)

    monkeypatch.setattr(StructuredOutputManager, "_compile", blocking_compile)
    manager = LLMEngine(
        EngineConfig(model=str(model_dir), max_model_len=128)
    ).parts.structured_output

    async def main() -> list[Future]:
        running, let_go = manager.hold(StructuredOutputsParams(regex="slow"))
        assert await asyncio.to_thread(started.wait, 20)  # the small lane is busy
        waiting = asyncio.ensure_future(
            prepare(manager, StructuredOutputsParams(regex="[ab]{4}"), ThreadPoolExecutor(1))
        )
        while manager.num_cached_grammars < 2:
            await asyncio.sleep(0.01)
        queued = [e.future for e in manager._compiles.values() if e.future is not running]
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        let_go()
        release.set()
        running.result(timeout=30)
        return queued

    (queued,) = asyncio.run(main())
    assert queued.cancelled()
    assert manager.num_cached_grammars == 1  # the one that ran
    manager.shutdown()
