"""Anthropic Messages bodies into the chat path's request, in process: the room's fast-tier
test (tests/server/test_messages_api.py drives the same mapping through a real server)."""

from __future__ import annotations

import pytest

from tokenmill.entrypoints.http.anthropic.convert import chat_request
from tokenmill.entrypoints.http.anthropic.protocol import MessagesRequest
from tokenmill.entrypoints.http.transport.errors import OpenAIError

TOOL = {
    "name": "multiply",
    "description": "Multiply two whole numbers.",
    "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
}


def converted(**body) -> dict:
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body})
    return chat_request(request).model_dump(exclude_none=True)


def test_a_tool_round_trip_becomes_chat_messages_as_vllm_maps_them() -> None:
    chat = converted(
        system="Be brief.",
        tools=[TOOL],
        tool_choice={"type": "any"},
        messages=[
            {"role": "user", "content": "What is 3 times 4?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me multiply."},
                    {"type": "tool_use", "id": "toolu_1", "name": "multiply", "input": {"a": 3}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "12"}],
            },
        ],
    )
    roles = [message["role"] for message in chat["messages"]]
    assert roles == ["system", "user", "assistant", "tool"]
    assert chat["messages"][0]["content"] == "Be brief."
    call = chat["messages"][2]["tool_calls"][0]
    assert call["id"] == "toolu_1" and call["function"]["name"] == "multiply"
    assert call["function"]["arguments"] == '{"a": 3}'
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "12"}
    assert chat["tool_choice"] == "required"
    assert chat["tools"][0]["function"]["name"] == "multiply"


def test_a_named_tool_choice_without_a_name_is_a_400_naming_the_field() -> None:
    with pytest.raises(OpenAIError, match="tool_choice") as refused:
        converted(
            tools=[TOOL], tool_choice={"type": "tool"}, messages=[{"role": "user", "content": "Hi"}]
        )
    assert refused.value.status_code == 400
