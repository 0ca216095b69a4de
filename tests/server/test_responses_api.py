"""/v1/responses with the official openai client, unmodified, against the demo model: text,
streaming, function tools and their outputs, previous_response_id over the bounded store,
store: false, GET / DELETE, errors in OpenAI's shape; payloads checked with the SDK's types."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response
from server_clients import openai_client
from server_utils import API_KEY, Server, start_server, stop_server
from test_openapi import openai_schema, validate  # noqa: F401 (fixtures)

from tokenmill.demo import DEMO_TARGET_NAME
from tokenmill.entrypoints.http.responses.store import ResponseStore, stored_size
from tokenmill_testing.weather_tool import RESPONSES_WEATHER_TOOL, WEATHER_SCHEMA

PROMPT = "Say these words backwards: cake egg peach shell honey"
TOOLS = [RESPONSES_WEATHER_TOOL]


@pytest.fixture(scope="module")
def responses_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    log_path = tmp_path_factory.mktemp("responses") / "server.log"
    server: Server = start_server(None, log_path, "--max-model-len", "1024")
    yield openai_client(server)
    stop_server(server)


def _create(client: openai.OpenAI, **fields) -> Response:
    body = {"model": DEMO_TARGET_NAME, "input": PROMPT, "max_output_tokens": 16, **fields}
    return client.responses.create(**body)


def test_a_text_response(responses_client) -> None:
    response = _create(responses_client, temperature=0, instructions="Do as you are told.")
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text
    assert response.usage.input_tokens > 0 and 0 < response.usage.output_tokens <= 16
    assert response.instructions == "Do as you are told."


def test_a_response_cut_by_max_output_tokens_is_incomplete(responses_client) -> None:
    response = _create(responses_client, temperature=0, max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_build_the_same_response(responses_client) -> None:
    whole = _create(responses_client, temperature=0)
    body = {"model": DEMO_TARGET_NAME, "input": PROMPT, "max_output_tokens": 16}
    with responses_client.responses.stream(**body, temperature=0) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in types and "response.output_item.done" in types
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert responses_client.responses.retrieve(final.id).output_text == whole.output_text


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_calls_validate_and_stream_the_same(responses_client, tool_choice) -> None:
    fields = {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False}
    fields.update(max_output_tokens=200, temperature=0)
    whole = _create(responses_client, **fields)
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    body = {"model": DEMO_TARGET_NAME, "input": PROMPT, **fields}
    with responses_client.responses.stream(**body) as stream:
        final = stream.get_final_response()
    assert [(i.name, i.arguments) for i in final.output] == [(call.name, call.arguments)]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_calls_validate_every_time_at_temperature_1(responses_client, tool_choice) -> None:
    fields = {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False}
    for _ in range(20):  # the Responses API has no `n`
        response = _create(
            responses_client, temperature=1, max_output_tokens=200, store=False, **fields
        )
        [call] = response.output
        assert call.type == "function_call" and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)


def test_previous_response_id_continues_the_conversation(responses_client) -> None:
    first = _create(responses_client, tools=TOOLS, tool_choice="required",
                    parallel_tool_calls=False, max_output_tokens=200)  # fmt: skip
    [call] = first.output
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = _create(responses_client, input=[output], previous_response_id=first.id,
                     tools=TOOLS, tool_choice="none")  # fmt: skip
    assert second.previous_response_id == first.id
    # The stored conversation is read: the second prompt holds the first turn and its call.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.output[0].type == "message"


def test_store_false_and_delete(responses_client) -> None:
    unstored = _create(responses_client, store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        responses_client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as error:
        _create(responses_client, previous_response_id=unstored.id)
    assert error.value.body["param"] == "previous_response_id"
    stored = _create(responses_client, max_output_tokens=2)
    assert responses_client.responses.retrieve(stored.id).id == stored.id
    responses_client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        responses_client.responses.retrieve(stored.id)


def test_bad_requests_are_openai_400s(responses_client) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        _create(responses_client, tools=[{"type": "web_search"}])
    assert error.value.body["param"] == "tools.0"
    with pytest.raises(openai.BadRequestError) as error:
        _create(responses_client, input=[{"type": "function_call_output", "call_id": "x",
                                          "output": "1"}])  # fmt: skip
    assert "tool" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        _create(responses_client, tools=TOOLS, tool_choice={"type": "function", "name": "no"})
    properties = {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(15_000)}
    huge = {"type": "function", "name": "big", "parameters": {"type": "object",
            "properties": properties}}  # about 1 MB  # fmt: skip
    with pytest.raises(openai.BadRequestError):
        _create(responses_client, tools=[huge], tool_choice="required")
    assert _create(responses_client, max_output_tokens=2).output  # still serving


def test_the_store_is_bounded_by_count_and_age() -> None:
    store = ResponseStore(max_responses=2, max_age=3600)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is None and store.get("r2") is not None and len(store) == 2
    aged = ResponseStore(max_responses=10, max_age=-1)  # everything is already too old
    aged.put({"id": "r"}, [])
    assert aged.get("r") is None


def test_payloads_match_openais_schema(
    responses_client,
    validate,  # noqa: F811 (the fixture)
) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = str(responses_client.base_url).removesuffix("/")
    plain = {"model": DEMO_TARGET_NAME, "input": PROMPT, "max_output_tokens": 8}
    calls = {**plain, "tools": TOOLS, "tool_choice": "required", "max_output_tokens": 200}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        for body in (plain, calls):
            validate("Response", http.post("/responses", json=body).json())
            with http.stream("POST", "/responses", json={**body, "stream": True}) as reply:
                lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
            for line in lines:
                validate("ResponseStreamEvent", json.loads(line.removeprefix("data: ")))


def test_the_store_is_bounded_by_bytes_oldest_first() -> None:
    evicted: list[str] = []
    big = {"metadata": {f"k{i}": "v" * 512 for i in range(16)}}
    one = stored_size({"id": "r0", **big}, [])
    store = ResponseStore(max_bytes=3 * one + one // 2, on_evict=evicted.append)
    for i in range(5):
        store.put({"id": f"r{i}", **big}, [])
        assert store.num_bytes <= store.max_bytes
    assert [store.get(f"r{i}") is not None for i in range(5)] == [False, False, True, True, True]
    assert evicted == ["bytes", "bytes"]
    store.delete("r4")
    assert store.num_bytes == 2 * one


def test_a_stored_response_is_only_its_keys() -> None:
    store = ResponseStore()
    store.put({"id": "r"}, [], owner="key-a")
    assert store.get("r", "key-b") is None and not store.delete("r", "key-b")
    assert store.get("r") is None  # no key is not key-a either
    assert store.get("r", "key-a") is not None and store.delete("r", "key-a")
