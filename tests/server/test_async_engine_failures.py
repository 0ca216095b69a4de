"""The async engine in-process, with faults injected: a failing step costs only its requests, a
dead loop is reported, an abort frees KV within a step."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError, EngineStepError
from tokenmill.engine.intake import EngineRequest
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.http.app import build_app
from tokenmill.entrypoints.http.context import ServerContext
from tokenmill.metrics.prometheus import EngineMetrics
from tokenmill.sampling_params import InvalidRequestError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def make_engine(model_dir: Path) -> Callable[[], LLMEngine]:
    return lambda: LLMEngine(EngineConfig(model=str(model_dir), max_model_len=128))


def fail_step_number(engine: LLMEngine, number: int, error: BaseException) -> None:
    """Make the engine's `number`-th step from now raise `error`."""
    real_step = engine.step
    calls = 0

    def step() -> Any:
        nonlocal calls
        calls += 1
        if calls == number:
            raise error
        return real_step()

    engine.step = step  # type: ignore[method-assign]


async def collect(async_engine: AsyncEngine, prompt: str, request_id: str) -> str:
    texts = []
    async for output in async_engine.generate(prompt, GREEDY, request_id):
        texts.extend(c.text for c in output.outputs)
    return "".join(texts)


def all_blocks_free(engine: LLMEngine) -> bool:
    manager = engine.kv_cache_manager
    return manager.num_free_blocks == manager.num_blocks


def test_generate_streams_deltas_that_add_up(make_engine: Callable[[], LLMEngine]) -> None:
    engine = make_engine()
    [expected] = [o.outputs[0].text for o in _offline(engine, "Hello there")]

    async def main() -> None:
        async_engine = AsyncEngine(engine, log_stats_interval=None)
        async_engine.start()
        try:
            assert await collect(async_engine, "Hello there", "a") == expected
            with pytest.raises(InvalidRequestError):
                await async_engine.add_requests([EngineRequest("b", [10**9], GREEDY)])
        finally:
            async_engine.shutdown()

    asyncio.run(main())
    assert all_blocks_free(engine)


def test_a_failing_step_fails_its_requests_and_the_engine_serves_on(
    make_engine: Callable[[], LLMEngine],
) -> None:
    engine = make_engine()
    registry = CollectorRegistry()

    async def main() -> None:
        async_engine = AsyncEngine(engine, EngineMetrics(registry, "m"), log_stats_interval=None)
        async_engine.start()
        try:
            fail_step_number(engine, 3, RuntimeError("injected"))
            with pytest.raises(EngineStepError, match="injected"):
                await collect(async_engine, "Hello there", "doomed")
            assert async_engine.is_healthy
            assert await collect(async_engine, "Hello there", "fine")
        finally:
            async_engine.shutdown()

    asyncio.run(main())
    assert all_blocks_free(engine) and not engine.has_unfinished_requests()
    failed = registry.get_sample_value(
        "tokenmill:request_success_total", {"model_name": "m", "finished_reason": "error"}
    )
    assert failed == 1


def test_an_abort_frees_kv_within_one_step(make_engine: Callable[[], LLMEngine]) -> None:
    engine = make_engine()
    real_abort = engine.abort_request
    steps_at_abort: list[int] = []

    def abort_request(request_ids: Any) -> None:
        steps_at_abort.append(engine.num_steps)
        real_abort(request_ids)

    engine.abort_request = abort_request  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=100, ignore_eos=True)

    async def main() -> None:
        async_engine = AsyncEngine(engine, log_stats_interval=None)
        async_engine.start()
        try:
            outputs = async_engine.generate("Hello there", params, "leaver")
            await anext(outputs)
            await anext(outputs)
            steps_when_leaving = engine.num_steps
            await outputs.aclose()
            for _ in range(200):
                if steps_at_abort and all_blocks_free(engine):
                    break
                await asyncio.sleep(0.005)
            assert steps_at_abort[0] - steps_when_leaving <= 1
        finally:
            async_engine.shutdown()

    asyncio.run(main())
    assert all_blocks_free(engine) and not engine.has_unfinished_requests()


class _Fatal(BaseException):
    """Not an Exception: escapes the step's error handling and kills the loop."""


def test_a_dead_loop_fails_streams_and_health(make_engine: Callable[[], LLMEngine]) -> None:
    engine = make_engine()
    async_engine = AsyncEngine(engine, log_stats_interval=None)
    app = build_app(ServerContext(async_engine, ["m"], "here"), CollectorRegistry(), None)
    body = {"prompt": "Hello there", "max_tokens": 8}

    async def main() -> None:
        async_engine.start()  # the ASGI transport runs no lifespan
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/health")).status_code == 200
            fail_step_number(engine, 2, RuntimeError("injected"))
            failed = await client.post("/v1/completions", json=body)
            assert failed.status_code == 500
            assert failed.json()["error"]["type"] == "server_error"
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            assert (await client.get("/health")).status_code == 200

            fail_step_number(engine, 1, _Fatal())
            with pytest.raises(EngineDeadError):
                await collect(async_engine, "Hello there", "last")
            assert not async_engine.is_healthy
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
            assert (await client.post("/v1/completions", json=body)).status_code == 503
        async_engine.shutdown()

    asyncio.run(main())


def _offline(engine: LLMEngine, prompt: str) -> list[Any]:
    params = GREEDY.clone()
    engine.add_request("offline", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(o for o in engine.step() if o.finished)
    return outputs


def test_a_request_whose_data_cannot_be_hashed_fails_alone(
    make_engine: Callable[[], LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the boundary's validation (turned off here), a cache_salt that cannot be hashed
    fails its own add, not the engine step every running request shares."""
    monkeypatch.setattr("tokenmill.engine.intake.check_cache_salt", lambda salt: None)
    engine = make_engine()
    [expected] = [o.outputs[0].text for o in _offline(engine, "Hello there")]

    async def main() -> None:
        async_engine = AsyncEngine(engine, log_stats_interval=None)
        async_engine.start()
        try:
            innocent = [
                asyncio.ensure_future(collect(async_engine, "Hello there", f"innocent-{i}"))
                for i in range(12)
            ]
            await asyncio.sleep(0.05)
            poison = EngineRequest("poison", "Hello there", GREEDY, cache_salt="\ud800")
            with pytest.raises(UnicodeEncodeError):
                await async_engine.add_requests([poison])
            assert await asyncio.gather(*innocent) == [expected] * 12
        finally:
            async_engine.shutdown()

    asyncio.run(main())
    assert all_blocks_free(engine) and not engine.has_unfinished_requests()


def in_process_app(engine: LLMEngine, **context: Any) -> tuple[AsyncEngine, Any]:
    async_engine = AsyncEngine(engine, log_stats_interval=None)
    ctx = ServerContext(async_engine, ["m"], "here", **context)
    return async_engine, build_app(ctx, CollectorRegistry(), None)


def test_prompt_tokens_details_are_reported_only_when_enabled(
    make_engine: Callable[[], LLMEngine],
) -> None:
    """cached_tokens tells a client whether another's prompt shares its prefix: off by
    default, as vLLM's --enable-prompt-tokens-details."""
    engine = make_engine()
    body = {"prompt": "Hello there " * 8, "max_tokens": 2}

    async def usage(enabled: bool) -> dict[str, Any]:
        async_engine, app = in_process_app(engine, enable_prompt_tokens_details=enabled)
        async_engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await client.post("/v1/completions", json=body)
            response = await client.post("/v1/completions", json=body)
        async_engine.shutdown()
        return response.json()["usage"]

    assert "prompt_tokens_details" not in asyncio.run(usage(False))
    assert asyncio.run(usage(True))["prompt_tokens_details"]["cached_tokens"] > 0


def test_tokenizing_runs_off_the_event_loop(make_engine: Callable[[], LLMEngine]) -> None:
    """A /tokenize call whose tokenizing is held until /health has answered: /health, asked
    while it runs, answers (before the fix the tokenizer held the event loop, so /health could
    only answer after the tokenizing was done). Ordering, not timing: the waits are hang
    guards."""
    engine = make_engine()
    async_engine, app = in_process_app(engine)
    tokenizer = engine.tokenizer
    real_encode = tokenizer.encode
    encoding, release = threading.Event(), threading.Event()

    def held_encode(*args: Any, **kwargs: Any) -> list[int]:
        encoding.set()
        release.wait(60)  # a long prompt, until the test lets it finish
        return real_encode(*args, **kwargs)

    async def main() -> None:
        async_engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            tokenizing = asyncio.ensure_future(client.post("/tokenize", json={"prompt": "x"}))
            assert await asyncio.to_thread(encoding.wait, 60), "the tokenizer was never called"
            assert (await client.get("/health")).status_code == 200
            assert not tokenizing.done()  # /health answered while the tokenizer still ran
            release.set()
            assert (await tokenizing).status_code == 200
        async_engine.shutdown()

    tokenizer.encode = held_encode
    try:
        asyncio.run(main())
    finally:
        release.set()
        tokenizer.encode = real_encode


def test_a_new_schema_is_checked_on_its_own_thread_not_the_engine_thread(
    make_engine: Callable[[], LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checking a large schema takes tens of milliseconds: on the engine thread every running
    request would wait for it, on the tokenizer thread every request's tokenizing. The server
    checks it on a thread of its own, once; the engine's own check of the same constraint is a
    lookup. A bad schema is still a 400 naming it."""
    from tokenmill.structured_output import backend

    threads: list[str] = []
    real_check = backend._check

    def recording_check(params: Any) -> None:
        threads.append(threading.current_thread().name)
        real_check(params)

    monkeypatch.setattr(backend, "_check", recording_check)
    schema = {"type": "object", "properties": {"unique_to_this_test": {"type": "integer"}}}
    engine = make_engine()
    async_engine, app = in_process_app(engine)

    async def main() -> tuple[int, int]:
        async_engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"prompt": "Hi", "max_tokens": 3, "guided_json": schema}
            good = await client.post("/v1/completions", json=body)
            bad_schema = {"type": "object", "properties": {"x": {"minimum": "low"}}}
            bad = await client.post("/v1/completions", json={**body, "guided_json": bad_schema})
            assert bad.json()["error"]["param"] == "guided_json"
        async_engine.shutdown()
        return good.status_code, bad.status_code

    assert asyncio.run(main()) == (200, 400)
    assert len(threads) == 2, threads  # each schema checked once, the good one not again
    assert all(name.startswith("tokenmill-schema-check") for name in threads), threads
