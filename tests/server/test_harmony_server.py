"""`tokenmill serve --reasoning-parser openai_gptoss --tool-call-parser openai`: a harmony
reply (gpt-oss's format) with its reasoning and a tool call, through the chat completions API
(whole and streamed) and the Messages API. The model is scripted (tokenmill_testing) to write
the reply to any chat; each harmony marker run is one added token, since a scripted model
writes each token once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_clients import openai_client
from server_utils import API_KEY, MODEL, Server, start_server, stop_server

from tokenmill.demo import demo_model_path
from tokenmill_testing.scripted_checkpoint import save_scripted_checkpoint
from tokenmill_testing.weather_tool import CHAT_WEATHER_TOOL, MESSAGES_WEATHER_TOOL

THINKING = "Paris weather needed."
ARGUMENTS = '{"city": "Paris", "days": 2}'
PIECES = (
    "<|channel|>analysis<|message|>",
    THINKING,
    "<|end|><|start|>assistant",
    "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
    ARGUMENTS,
    "<|call|>",
)
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = tmp_path_factory.mktemp("harmony")
    save_scripted_checkpoint(
        model_dir, "".join(PIECES), demo_model_path("target"), added_tokens=PIECES
    )
    args = ("--reasoning-parser", "openai_gptoss", "--max-model-len", "512")
    args += ("--enable-auto-tool-choice", "--tool-call-parser", "openai")
    server = start_server(Path(model_dir), model_dir / "server.log", *args)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai_client(server)


def _chat(client: openai.OpenAI, **fields):
    return client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[CHAT_WEATHER_TOOL],
        max_tokens=40,
        temperature=0,
        reasoning_effort="low",
        **fields,
    )


def test_chat_reply_has_reasoning_and_a_tool_call(client: openai.OpenAI) -> None:
    choice = _chat(client).choices[0]
    assert (choice.message.model_extra or {}).get("reasoning_content") == THINKING
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(ARGUMENTS)
    assert choice.finish_reason == "tool_calls"


def test_streamed_chat_reply_has_reasoning_and_a_tool_call(client: openai.OpenAI) -> None:
    reasoning, content, names, arguments = "", "", [], ""
    for chunk in _chat(client, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                names += [call.function.name] if call.function.name else []
                arguments += call.function.arguments or ""
    assert (reasoning, content, names) == (THINKING, "", ["get_weather"])
    assert json.loads(arguments) == json.loads(ARGUMENTS)


def test_messages_api_gets_thinking_then_tool_use(server: Server) -> None:
    anthropic = pytest.importorskip("anthropic")
    claude = anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
    message = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=MESSAGES,
        tools=[MESSAGES_WEATHER_TOOL],
        extra_body={"temperature": 0},
    )
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == THINKING
    assert message.content[1].input == json.loads(ARGUMENTS)
    assert message.stop_reason == "tool_use"
