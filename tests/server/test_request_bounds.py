"""Issue 40: no request can freeze the server or earn a 500 by its shape. Bounds named in the
400 (tools), linear checks off the event loop (a large allowed body leaves /health answering),
deep nesting refused without recursion, and the Messages/Responses bodies that were 500s.
Against one demo-model server (it has a chat template and knows the `multiply` tool)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_utils import API_KEY, Server, start_server, stop_server

from tokenmill.demo import DEMO_TARGET_NAME
from tokenmill.entrypoints.http.transport.body_checks import MAX_JSON_DEPTH, MAX_TOOLS

USER = [{"role": "user", "content": "what is 3 times 4"}]
MULTIPLY = {"name": "multiply", "input_schema": {"type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}  # fmt: skip


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("bounds") / "server.log"
    server = start_server(None, log_path, "--max-model-len", "1024")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def http(demo: Server) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}", "x-api-key": API_KEY}
    with httpx.Client(base_url=demo.url, headers=headers, timeout=120) as http:
        yield http


def _tools(count: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(count)]


def test_more_tools_than_the_bound_is_a_400_naming_it(http: httpx.Client) -> None:
    """40,000 tools froze the server for 41 s (a quadratic unique-name check on the loop)."""
    body = {"model": DEMO_TARGET_NAME, "messages": USER, "tools": _tools(40_000)}
    started = time.monotonic()
    response = http.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools" and str(MAX_TOOLS) in error["message"]
    assert time.monotonic() - started < 10
    anthropic_tools = [{**MULTIPLY, "name": f"f{i}"} for i in range(MAX_TOOLS + 1)]
    messages = {"model": DEMO_TARGET_NAME, "max_tokens": 2, "messages": USER}
    refused = http.post("/v1/messages", json={**messages, "tools": anthropic_tools})
    assert refused.status_code == 400 and str(MAX_TOOLS) in refused.json()["error"]["message"]
    responses_tools = [{"type": "function", "name": f"f{i}"} for i in range(MAX_TOOLS + 1)]
    refused = http.post("/v1/responses", json={"input": "x", "tools": responses_tools})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


def test_large_bodies_do_not_stall_health(http: httpx.Client, demo: Server) -> None:
    """Bodies under the size cap: 20,000 tools (their quadratic check stalled every client for
    seconds; now refused at once) and one with the most tools allowed and many messages
    (checked and rendered off the event loop). /health keeps answering meanwhile; the bound
    is loose (2 s, a slow shared 2-core machine)."""
    messages = [{"role": "user", "content": "x"}] * 20_000
    allowed = {"model": DEMO_TARGET_NAME, "messages": messages, "tools": _tools(MAX_TOOLS),
               "tool_choice": "none", "max_tokens": 2}  # fmt: skip
    too_many = {**allowed, "messages": USER, "tools": _tools(20_000)}
    done = threading.Event()
    results: list[int] = []

    def attack() -> None:
        for body in (too_many, allowed, too_many, allowed):
            results.append(http.post("/v1/chat/completions", json=body).status_code)
        done.set()

    attacker = threading.Thread(target=attack)
    attacker.start()
    worst = 0.0
    with httpx.Client(base_url=demo.url, timeout=60) as probe:
        while not done.is_set():
            started = time.monotonic()
            assert probe.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.01)
    attacker.join()
    assert results == [400] * 4  # too many tools; a prompt longer than the context
    assert worst < 2.0, f"/health took {worst:.2f} s during a large request"


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5_000])
def test_deeply_nested_tool_call_arguments_are_a_400(http: httpx.Client, depth: int) -> None:
    """5,000 levels was a RecursionError 500 at chat, /tokenize and /v1/responses."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": _nested(depth)}}
    history = [*USER, {"role": "assistant", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "12"}]  # fmt: skip
    param = "messages.1.tool_calls.0.function.arguments"
    for path, body in (
        ("/v1/chat/completions", {"messages": history, "max_tokens": 2}),
        ("/tokenize", {"messages": history}),
    ):
        response = http.post(path, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    items = [{"role": "user", "content": "x"},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": _nested(depth)},
             {"type": "function_call_output", "call_id": "c1", "output": "12"}]  # fmt: skip
    response = http.post("/v1/responses", json={"input": items, "max_output_tokens": 2})
    assert response.status_code == 400, response.text


def test_a_body_nested_too_deep_is_a_400_naming_the_field(http: httpx.Client) -> None:
    deep: Any = 1
    for _ in range(MAX_JSON_DEPTH + 5):
        deep = [deep]
    body = {"messages": USER, "max_tokens": 2, "kv_transfer_params": {"x": deep}}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"].startswith("kv_transfer_params") and "levels deep" in error["message"]


def test_an_empty_responses_input_is_a_400_naming_it(http: httpx.Client) -> None:
    response = http.post("/v1/responses", json={"input": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"


@pytest.mark.parametrize(
    "choice", [{"type": "tool", "name": "multiply"}, {"type": "any"}], ids=["tool", "any"]
)
def test_forced_tool_use_cut_by_max_tokens_is_a_partial_reply(
    http: httpx.Client, demo: Server, choice: dict[str, Any]
) -> None:
    """Was a 500, unlogged; Anthropic answers the partial reply with stop_reason max_tokens."""
    body = {"model": DEMO_TARGET_NAME, "max_tokens": 3, "messages": USER, "tools": [MULTIPLY],
            "tool_choice": choice}  # fmt: skip
    for _ in range(3):
        response = http.post("/v1/messages", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["stop_reason"] == "max_tokens"
    assert "server error in" not in demo.log  # no 500 (each is logged)


def test_a_non_object_input_schema_is_a_400_before_any_work(http: httpx.Client) -> None:
    tool = {"name": "f", "input_schema": {"type": "string"}}
    body = {"model": DEMO_TARGET_NAME, "max_tokens": 2, "messages": USER, "tools": [tool],
            "tool_choice": {"type": "tool", "name": "f"}}  # fmt: skip
    before = http.get("/metrics").text.count("\n")
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 400
    assert "tools.0.input_schema" in response.json()["error"]["message"]
    assert before  # (the metrics route answered: nothing above failed the server)


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ([{"type": "text", "text": 5}], "messages.0.content.0.text"),
        (
            [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}],
            "messages.0.content.0.input",
        ),
    ],
    ids=["integer-text", "list-input"],
)
def test_messages_validation_errors_name_the_field(
    http: httpx.Client, content: list[dict[str, Any]], field: str
) -> None:
    body = {"model": DEMO_TARGET_NAME, "max_tokens": 2,
            "messages": [{"role": "assistant", "content": content}]}  # fmt: skip
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(f"{field}:")
