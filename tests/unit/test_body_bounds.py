"""Issue 40's per-request bounds, without a server: each check is linear and iterative, and
its refusal names the field and the limit."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from pydantic import ValidationError

from tokenmill.engine.async_engine import EngineStepError
from tokenmill.entrypoints.http.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.http.transport.body_checks import (
    MAX_JSON_DEPTH,
    MAX_TOOLS,
    InvalidBodyError,
    check_unicode,
)
from tokenmill.entrypoints.http.transport.errors import OpenAIError, log_server_error
from tokenmill.sampling_params import MAX_STOPS, InvalidRequestError, SamplingParams

USER = [{"role": "user", "content": "x"}]


def _tools(count: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(count)]


def test_the_tools_bound_is_checked_before_the_tools() -> None:
    started = time.monotonic()
    with pytest.raises(ValidationError, match=f"at most {MAX_TOOLS}"):
        ChatCompletionRequest.model_validate({"messages": USER, "tools": _tools(40_000)})
    assert time.monotonic() - started < 5  # a walk of 40,000 tools, nothing per pair
    assert len(ChatCompletionRequest.model_validate({"messages": USER,
               "tools": _tools(MAX_TOOLS)}).tools or []) == MAX_TOOLS  # fmt: skip


def test_a_body_walk_survives_any_depth_and_names_the_field() -> None:
    deep: Any = "x"
    for _ in range(10_000):  # far past Python's recursion limit
        deep = {"a": deep}
    with pytest.raises(InvalidBodyError) as error:
        check_unicode({"messages": USER, "kv_transfer_params": deep})
    assert error.value.param == "kv_transfer_params"
    assert str(MAX_JSON_DEPTH) in str(error.value)
    shallow: Any = "x"
    for _ in range(MAX_JSON_DEPTH - 1):
        shallow = [shallow]
    check_unicode({"p": shallow})  # at the limit: fine


def test_a_lone_surrogate_is_found_where_it_is() -> None:
    with pytest.raises(InvalidBodyError) as error:
        check_unicode({"messages": [{"content": "ok"}, {"content": ["a", "\ud800"]}]})
    assert error.value.param == "messages.1.content.1"


def test_nested_request_models_do_not_walk_the_body_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A walk per nested model walked 70,000 messages half a second on the event loop."""
    import tokenmill.entrypoints.http.openai.protocol as protocol

    calls: list[Any] = []
    monkeypatch.setattr(protocol, "check_unicode", calls.append)
    ChatCompletionRequest.model_validate({"messages": USER * 100, "tools": _tools(10)})
    assert len(calls) == 1


@pytest.mark.parametrize("name", ["stop", "stop_token_ids"])
def test_stop_lists_are_bounded(name: str) -> None:
    values: list[Any] = [f"s{i}" for i in range(MAX_STOPS + 1)]
    if name == "stop_token_ids":
        values = list(range(MAX_STOPS + 1))
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**{name: values})
    assert error.value.param == name and str(MAX_STOPS) in str(error.value)
    SamplingParams(**{name: values[:MAX_STOPS]})


def test_every_500_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        for error in (ValueError("bad"), EngineStepError("step"), OpenAIError(400, "client")):
            try:
                raise error
            except Exception as e:
                log_server_error(e, "POST /v1/messages")
    logged = [r for r in caplog.records if "server error" in r.getMessage()]
    assert [r.exc_info[1] for r in logged if r.exc_info] == [  # the 400 is not logged
        caplog.records[0].exc_info[1],
        caplog.records[1].exc_info[1],
    ]
    assert len(logged) == 2


def test_route_bodies_are_validated_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid body becomes its model on a worker thread; an invalid one gets FastAPI's own
    answer (here its 422; the server's handlers make it a 400 naming the field)."""
    import threading

    from fastapi import APIRouter, FastAPI
    from fastapi.testclient import TestClient

    from tokenmill.entrypoints.http.transport import offloop_body

    threads: list[str] = []
    parse = offloop_body._parse

    def spy(body: bytes, model: Any) -> Any:
        threads.append(threading.current_thread().name)
        return parse(body, model)

    monkeypatch.setattr(offloop_body, "_parse", spy)
    router = APIRouter(route_class=offloop_body.OffLoopBodyRoute)

    @router.post("/chat")
    async def chat(request: ChatCompletionRequest) -> dict[str, int]:
        return {"messages": len(request.messages)}

    app = FastAPI()
    app.include_router(router)
    with TestClient(app) as client:
        answer = client.post("/chat", json={"messages": USER * 3})
        assert answer.json()["messages"] == 3
        assert client.post("/chat", json={"messages": []}).status_code == 422
        assert client.post("/chat", content=b"{", headers={"content-type": "application/json"})
    assert len(threads) == 3 and threading.current_thread().name not in threads
