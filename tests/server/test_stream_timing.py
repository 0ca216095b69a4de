"""When stream chunks leave, with the engine held at a gate: benchmark clients time the first
chunk as the first token, so nothing may go out before the engine has produced one."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.http.context import ServerContext
from tokenmill.entrypoints.http.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.http.openai.serving_chat import create_chat_completion

NOT_YET_SECONDS = 0.5  # how long the test waits for a chunk that must not come


@pytest.fixture(scope="module")
def gated_engine(model_dir: Path) -> Iterator[tuple[LLMEngine, threading.Event]]:
    """An engine whose steps wait until the gate is open."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=128))
    gate = threading.Event()
    real_step = engine.step

    def step() -> Any:
        assert gate.wait(30), "the test never opened the gate"
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    yield engine, gate


def test_chat_stream_sends_the_role_chunk_with_the_first_token(
    gated_engine: tuple[LLMEngine, threading.Event],
) -> None:
    engine, gate = gated_engine
    gate.clear()
    request = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True, "n": 2}
    )

    async def main() -> None:
        async_engine = AsyncEngine(engine, log_stats_interval=None)
        async_engine.start()
        try:
            ctx = ServerContext(async_engine, ["m"], "here")
            response = await create_chat_completion(ctx, request, None)  # type: ignore[arg-type]
            events: AsyncIterator[str] = response.body_iterator  # type: ignore[attr-defined]
            first = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({first}, timeout=NOT_YET_SECONDS)
            assert not done, f"a chunk left before any token existed: {first.result()}"
            gate.set()
            chunks = [
                json.loads(e.removeprefix("data: "))
                for e in [await first, await anext(events), await anext(events)]
            ]
            assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
                {"role": "assistant", "content": ""}
            ] * 2
            assert {c["choices"][0]["index"] for c in chunks[:2]} == {0, 1}
            assert "role" not in chunks[2]["choices"][0]["delta"]  # the first token follows
            async for _ in events:
                pass
        finally:
            gate.set()
            async_engine.shutdown()

    asyncio.run(main())
