"""Every tool-call parser against recorded model outputs, whole and streamed: calls come out
as (name, JSON arguments), malformed calls come back as text, and the streamed pieces add up
to what the whole reply parses to, however the text is split into deltas."""

from __future__ import annotations

import json
import random

import pytest

from tokenmill.entrypoints.http.replies.tool_calling import ToolPlan
from tokenmill.entrypoints.http.replies.tool_parsers import get_tool_parser, tool_parser_names
from tokenmill.entrypoints.http.replies.tool_parsers.streaming import ToolCallStreamer

WEATHER = {"city": "Paris", "days": 3}
TIME = {"zone": "CET"}

# (parser, model output, expected calls [(name, arguments)], expected content)
RECORDED = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        "</tool_call>",
        [("get_weather", WEATHER)],
        None,
    ),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "days": 3}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
        [("get_weather", WEATHER), ("get_time", TIME)],
        "Let me check.\n",
    ),
    (  # the model stopped on its end token before closing the block
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n',
        [("get_time", TIME)],
        None,
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        [("get_weather", WEATHER)],
        None,
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
        [("get_weather", WEATHER), ("get_time", TIME)],
        None,
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "get_time", "arguments": {"zone": "CET"}}]',
        [("get_weather", WEATHER), ("get_time", TIME)],
        None,
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        [("get_weather", WEATHER)],
        "Sure. ",
    ),
    (
        "pythonic",
        '[get_weather(city="Paris", days=3), get_time(zone="CET")]',
        [("get_weather", WEATHER), ("get_time", TIME)],
        None,
    ),
]

MALFORMED = [
    ("hermes", 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call> and more text'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
    ("llama3_json", '{"city": "Paris"}'),  # JSON, but not a call
    ("mistral", "[TOOL_CALLS] [{"),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]not json"),
    ("pythonic", "[get_weather(city=Paris)]"),  # a name, not a literal
    ("pythonic", "[get_weather(1, 2)]"),
    ("pythonic", "[" * 500 + "]" * 500),
]

PLAIN = ["The weather is fine.", "", "   ", "[not a call", "{braces} in text", "a < b"]


def _calls(extracted) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in extracted.calls]


@pytest.mark.parametrize(("name", "text", "calls", "content"), RECORDED)
def test_recorded_calls_parse(name: str, text: str, calls: list, content: str | None) -> None:
    extracted = get_tool_parser(name).extract_tool_calls(text)
    assert _calls(extracted) == calls
    assert extracted.content == content


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_malformed_calls_come_back_as_text(name: str, text: str) -> None:
    extracted = get_tool_parser(name).extract_tool_calls(text)
    assert not extracted.tools_called
    assert extracted.content == text


@pytest.mark.parametrize("name", tool_parser_names())
@pytest.mark.parametrize("text", PLAIN)
def test_plain_text_is_content(name: str, text: str) -> None:
    extracted = get_tool_parser(name).extract_tool_calls(text)
    assert not extracted.tools_called
    assert extracted.content == text


def _stream(name: str, text: str, seed: int) -> tuple[str, list]:
    streamer = ToolCallStreamer(get_tool_parser(name))
    rng, position, content, calls = random.Random(seed), 0, "", []
    while position < len(text):
        step = rng.randint(1, 6)
        piece = streamer.feed(text[position : position + step])
        position += step
        content += piece.content
        calls += piece.calls
    piece = streamer.finish()
    return content + piece.content, calls + piece.calls


ALL_OUTPUTS = [(n, t) for n, t, _, _ in RECORDED] + MALFORMED
ALL_OUTPUTS += [(n, t) for n in tool_parser_names() for t in PLAIN]


@pytest.mark.parametrize(("name", "text"), ALL_OUTPUTS)
@pytest.mark.parametrize("seed", range(3))
def test_streamed_pieces_reassemble_to_the_whole_parse(name: str, text: str, seed: int) -> None:
    whole = get_tool_parser(name).extract_tool_calls(text)
    content, calls = _stream(name, text, seed)
    assert calls == whole.calls
    assert content == (whole.content or "")


def test_hermes_sends_a_call_as_soon_as_its_block_closes() -> None:
    streamer = ToolCallStreamer(get_tool_parser("hermes"))
    assert streamer.feed("Checking. <tool").content == "Checking. "
    piece = streamer.feed('_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    assert [c.name for c in piece.calls] == ["get_time"]
    assert streamer.finish().calls == []


def test_mistral_call_ids_are_nine_alphanumerics() -> None:
    call_id = get_tool_parser("mistral").make_call_id()
    assert len(call_id) == 9 and call_id.isalnum()


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def test_auto_tool_choice_without_a_parser_is_refused_at_start_up() -> None:
    import argparse

    from tokenmill.entrypoints.http.replies.reply_parsing import reply_parsing_from_args

    args = argparse.Namespace(enable_auto_tool_choice=True, tool_call_parser=None)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        reply_parsing_from_args(args)
    args = argparse.Namespace(enable_auto_tool_choice=True, tool_call_parser="hermes")
    assert reply_parsing_from_args(args).tool_parser() is not None


_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'


@pytest.mark.parametrize(
    "text, num_calls",
    [
        (f"[{_CALL}]", 1),
        (f" [ {_CALL} , {_CALL} ] ", 2),
        (f'[{_CALL}, {{"na', 1),  # cut by max_tokens inside the second call
        (f"[{_CALL}", 1),  # cut before its `]`
        (f"[{_CALL}, ", 1),
        ('[{"name": "get_weather", "param', 0),  # nothing whole: text
        (f"[{_CALL}] and more", 0),  # not the constrained array: text
        ("[", 0),
    ],
)
def test_required_array_keeps_the_calls_written_whole(text: str, num_calls: int) -> None:
    extracted = ToolPlan("required").parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == [
        ("get_weather", WEATHER)
    ] * num_calls
    assert extracted.content == (None if num_calls else text)
