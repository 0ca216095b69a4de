"""Reasoning parsers against recorded replies: the thinking goes to reasoning_content, the rest
to content, whole and streamed (a tag split across deltas included); tool parsing reads only
the part after the reasoning."""

from __future__ import annotations

import json
import random

import pytest

from tokenmill.entrypoints.http.replies.reasoning import ReasoningStreamer, get_reasoning_parser
from tokenmill.entrypoints.http.replies.reply_parsing import ReplyStream, parse_reply
from tokenmill.entrypoints.http.replies.tool_calling import ToolPlan
from tokenmill.entrypoints.http.replies.tool_parsers import get_tool_parser

# (parser, reply, reasoning, content)
RECORDED = [
    ("deepseek_r1", "Let me add.</think>5", "Let me add.", "5"),
    ("deepseek_r1", "<think>Let me add.</think>\n\n5", "Let me add.", "\n\n5"),
    (
        "deepseek_r1",
        "still thinking when max_tokens hit",
        "still thinking when max_tokens hit",
        None,
    ),
    ("deepseek_r1", "</think>direct", None, "direct"),
    ("qwen3", "<think>\nhmm\n</think>\n\nParis.", "\nhmm\n", "\n\nParis."),
    ("qwen3", "Paris.", None, "Paris."),  # thinking off
    ("qwen3", "no <think> at the start</think>", None, "no <think> at the start</think>"),
    ("qwen3", "<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),
]


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), RECORDED)
def test_recorded_replies_split(name, text, reasoning, content) -> None:
    split = get_reasoning_parser(name).split(text)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize(("name", "text", "reasoning", "content"), RECORDED)
@pytest.mark.parametrize("seed", range(4))
def test_streamed_split_matches_the_whole_split(name, text, reasoning, content, seed) -> None:
    streamer = ReasoningStreamer(get_reasoning_parser(name))
    rng, position, parts = random.Random(seed), 0, ["", ""]
    while position < len(text):
        step = rng.randint(1, 4)
        for i, piece in enumerate(streamer.feed(text[position : position + step])):
            parts[i] += piece
        position += step
    for i, piece in enumerate(streamer.finish()):
        parts[i] += piece
    assert (parts[0] or None, parts[1] or None) == (reasoning, content)


def test_tool_calls_are_read_after_the_reasoning() -> None:
    reply = (
        '<think>I should call <tool_call>{"name": "no", "arguments": {}}</tool_call>?</think>'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    )
    plan = ToolPlan("auto", parser=get_tool_parser("hermes"))
    parsed = parse_reply(reply, plan, get_reasoning_parser("qwen3"))
    assert [c.function.name for c in parsed.tool_calls] == ["get_time"]
    assert json.loads(parsed.tool_calls[0].function.arguments) == {"zone": "CET"}
    assert parsed.reasoning_content.startswith("I should call <tool_call>")
    assert parsed.content is None

    stream = ReplyStream(plan, get_reasoning_parser("qwen3"))
    deltas = [d for i in range(0, len(reply), 5) for d in stream.feed(reply[i : i + 5])]
    deltas += stream.finish()
    reasoning = "".join(d.reasoning_content or "" for d in deltas)
    names = [c.function.name for d in deltas for c in d.tool_calls or [] if c.function.name]
    assert reasoning == parsed.reasoning_content
    assert names == ["get_time"]
    assert not any(d.content for d in deltas)


@pytest.mark.parametrize(
    ("prompt", "ended"),
    [
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", True),  # Qwen3, thinking off
        ("<|im_start|>assistant\n<think>\n", False),  # DeepSeek-R1 opens it
        ("<|im_start|>assistant\n", False),
        ("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", False),  # an earlier turn's
    ],
)
def test_a_prompt_that_closes_the_reasoning_constrains_from_the_first_token(prompt, ended):
    for name in ("deepseek_r1", "qwen3"):
        assert get_reasoning_parser(name).ended_in_prompt(prompt) is ended
