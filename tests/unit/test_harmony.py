"""gpt-oss's harmony replies (replies/harmony.py): `--reasoning-parser openai_gptoss` and
`--tool-call-parser openai`, whole and delta by delta, alone and together."""

from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.http.replies.harmony import parse_harmony
from tokenmill.entrypoints.http.replies.reasoning import get_reasoning_parser
from tokenmill.entrypoints.http.replies.reply_parsing import (
    ReplyStream,
    keeps_special_tokens,
    parse_reply,
)
from tokenmill.entrypoints.http.replies.tool_calling import ToolPlan
from tokenmill.entrypoints.http.replies.tool_parsers import get_tool_parser

THINK = "<|channel|>analysis<|message|>The user wants Paris' weather.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris", "days": 2}<|call|>'
)
ANSWER = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"
AUTO = ToolPlan("auto", parser=get_tool_parser("openai"))
REASONING = get_reasoning_parser("openai_gptoss")


def test_messages_channels_and_recipients() -> None:
    messages = parse_harmony(THINK + CALL)
    assert [(m.channel, m.function) for m in messages] == [
        ("analysis", None),
        ("commentary", "get_weather"),
    ]
    assert messages[1].text == '{"city": "Paris", "days": 2}'
    # The recipient may sit in the role header instead of after the channel.
    header_form = '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}'
    assert parse_harmony(header_form)[0].function == "f"


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        (THINK + ANSWER, "The user wants Paris' weather.", "It is sunny in Paris."),
        (THINK, "The user wants Paris' weather.", None),  # cut off after the reasoning
        ("Just text.", None, "Just text."),  # a reply that never used harmony
        (THINK + "<|start|>assistant<|channel|>final<|message|>Cut", None, "Cut"),
    ],
)
def test_reasoning_and_answer(text: str, reasoning: str | None, content: str | None) -> None:
    reply = parse_reply(text, ToolPlan("none"), REASONING)
    assert reply.content == content
    if reasoning is not None:
        assert reply.reasoning_content == reasoning


def test_reasoning_then_tool_call() -> None:
    reply = parse_reply(THINK + CALL, AUTO, REASONING)
    assert reply.reasoning_content == "The user wants Paris' weather."
    assert reply.content is None
    [call] = reply.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


def test_tool_parser_alone_drops_the_analysis_and_keeps_the_answer() -> None:
    reply = parse_reply(THINK + ANSWER, AUTO, None)
    assert (reply.content, reply.tool_calls) == ("It is sunny in Paris.", [])
    bad = CALL.replace('{"city": "Paris", "days": 2}', "not json")
    assert parse_reply(bad, AUTO, None).tool_calls == []  # a broken call stays text


@pytest.mark.parametrize("step", [1, 4, 9])
def test_streamed_deltas_equal_the_whole_reply(step: int) -> None:
    text = THINK + CALL
    stream = ReplyStream(AUTO, REASONING)
    deltas = [m for i in range(0, len(text), step) for m in stream.feed(text[i : i + step])]
    deltas += stream.finish()
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [c for d in deltas for c in d.tool_calls or []]
    assert reasoning == "The user wants Paris' weather."
    assert content == ""  # no marker leaks
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {
        "city": "Paris",
        "days": 2,
    }


def test_streamed_answer_holds_a_partial_marker() -> None:
    stream = ReplyStream(ToolPlan("none"), REASONING)
    text = THINK + ANSWER
    deltas = [m for i in range(0, len(text), 2) for m in stream.feed(text[i : i + 2])]
    deltas += stream.finish()
    assert "".join(d.content or "" for d in deltas) == "It is sunny in Paris."
    assert "".join(d.reasoning_content or "" for d in deltas) == "The user wants Paris' weather."


def test_harmony_parsers_decode_special_tokens() -> None:
    assert keeps_special_tokens(AUTO, None)
    assert keeps_special_tokens(ToolPlan("none"), REASONING)
    assert not keeps_special_tokens(ToolPlan("none"), get_reasoning_parser("qwen3"))


def test_reasoning_effort_reaches_the_chat_template(tokenizer_dir) -> None:
    """`reasoning_effort` (chat; the Responses API's `reasoning.effort`) is a template
    variable, as gpt-oss's template reads it into its system message."""
    from transformers import AutoTokenizer

    from tokenmill.entrypoints.http.openai.inputs import PromptBuilder
    from tokenmill.entrypoints.http.openai.protocol import ChatMessage
    from tokenmill.entrypoints.http.responses.convert import chat_request
    from tokenmill.entrypoints.http.responses.protocol import ResponsesRequest

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = "Reasoning: {{ reasoning_effort | default('medium') }}"
    builder = PromptBuilder(tokenizer, len(tokenizer), 64)
    messages = [ChatMessage(role="user", content="Hi")]
    assert builder.render_chat(messages, True) == "Reasoning: medium"
    assert builder.render_chat(messages, True, reasoning_effort="low") == "Reasoning: low"
    request = ResponsesRequest.model_validate({"input": "Hi", "reasoning": {"effort": "high"}})
    assert chat_request(request, [{"role": "user", "content": "Hi"}]).reasoning_effort == "high"
