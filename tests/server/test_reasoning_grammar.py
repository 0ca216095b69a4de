"""With `--reasoning-parser`, structured outputs and `required` / named tool choices hold for
the reply after the reasoning, as vLLM's grammar starts after the end-of-reasoning token: the
thinking stays free (`reasoning_content`), the rest is constrained and parsed. The model is
scripted (tokenmill_testing) to write "I add two.</think>yes" to any chat, its end tag spelled
in four ordinary tokens; the constrained part is whatever its argmax takes within the grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from server_clients import openai_client
from server_utils import API_KEY, MODEL, Server, start_server, stop_server

from tokenmill.demo import demo_model_path
from tokenmill_testing.scripted_checkpoint import save_scripted_checkpoint
from tokenmill_testing.weather_tool import (
    CHAT_WEATHER_CHOICE,
    CHAT_WEATHER_TOOL,
    MESSAGES_WEATHER_TOOL,
    WEATHER_SCHEMA,
)

THINKING = "I add two."
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"sum": {"type": "string", "enum": ["four", "five"]}},
    "required": ["sum"],
    "additionalProperties": False,
}
TOOLS = [CHAT_WEATHER_TOOL]
NAMED = CHAT_WEATHER_CHOICE
# Room for the reasoning and one whole weather call in this tokenizer's tokens (60 cut the call
# inside "days"; a cut call comes back as text, not a call).
TOOL_CALL_TOKENS = 120
JSON_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = tmp_path_factory.mktemp("thinker")
    save_scripted_checkpoint(model_dir, f"{THINKING}</think>yes", demo_model_path("target"))
    args = ("--reasoning-parser", "deepseek_r1", "--max-model-len", "1024")
    args += ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    server = start_server(Path(model_dir), model_dir / "server.log", *args)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(thinker: Server) -> openai.OpenAI:
    return openai_client(thinker)


def _chat(client: openai.OpenAI, **fields):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "temperature": 0, **fields}
    return client.chat.completions.create(**body)


def _streamed(client: openai.OpenAI, **fields) -> tuple[str, str, list[tuple[str, str]], str]:
    """(reasoning, content, calls as (name, arguments), finish_reason) from the deltas."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in _chat(client, stream=True, **fields):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, [tuple(c) for _, c in sorted(calls.items())], finish


def test_an_unconstrained_reply_splits_at_the_end_tag(client) -> None:
    message = _chat(client).choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (THINKING, "yes")


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": JSON_FORMAT},
        {"extra_body": {"structured_outputs": {"json": ANSWER_SCHEMA}}},
        {"extra_body": {"guided_json": ANSWER_SCHEMA}},
    ],
    ids=["response_format", "structured_outputs", "guided_json"],
)
def test_a_schema_holds_after_the_reasoning(client, fields) -> None:
    reply = _chat(client, **fields)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == THINKING
    jsonschema.validate(json.loads(message.content), ANSWER_SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    reasoning, content, _, _ = _streamed(client, **fields)
    assert (reasoning, content) == (THINKING, message.content)


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_forced_tool_calls_follow_the_reasoning(client, tool_choice) -> None:
    fields = {"tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": False}
    fields["max_tokens"] = TOOL_CALL_TOKENS
    reply = _chat(client, **fields)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == THINKING
    assert message.content is None and reply.choices[0].finish_reason == "tool_calls"
    [call] = message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    reasoning, content, calls, finish = _streamed(client, **fields)
    assert (reasoning, content, finish) == (THINKING, "", "tool_calls")
    assert calls == [("get_weather", call.function.arguments)]


def test_the_messages_api_gets_a_thinking_block_then_the_forced_tool_use(thinker) -> None:
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=thinker.url, api_key=API_KEY, max_retries=0)
    tools = [MESSAGES_WEATHER_TOOL]
    message = claude.messages.create(
        model=MODEL,
        max_tokens=TOOL_CALL_TOKENS,
        messages=MESSAGES,
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == THINKING
    jsonschema.validate(message.content[1].input, WEATHER_SCHEMA)
    assert message.stop_reason == "tool_use"
