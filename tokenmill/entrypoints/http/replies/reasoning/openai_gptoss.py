"""gpt-oss (harmony, replies/harmony.py): the `analysis` channel is the reasoning; the rest
is content, tool calls kept as written for `--tool-call-parser openai`. Its markers are
special tokens, so replies are decoded with them (`keeps_special_tokens`)."""

from __future__ import annotations

from dataclasses import replace

from tokenmill.entrypoints.http.replies.harmony import answer_of, parse_harmony, reasoning_of
from tokenmill.entrypoints.http.replies.reasoning.base import (
    ReasoningParser,
    ReasoningSplit,
    ReasoningStreamer,
    register_reasoning_parser,
)


@register_reasoning_parser("openai_gptoss")
class GptOssReasoningParser(ReasoningParser):
    start_tag = "<|channel|>analysis<|message|>"
    end_tag = "<|end|>"
    keeps_special_tokens = True

    def split(self, text: str) -> ReasoningSplit:
        messages = parse_harmony(text)
        return ReasoningSplit(reasoning_of(messages) or None, answer_of(messages) or None)

    def starts_in_reasoning(self, text: str) -> bool | None:
        return None  # not used: `streamer` reads the messages as they come

    def streamer(self) -> HarmonyStreamer:
        return HarmonyStreamer(self)


class HarmonyStreamer(ReasoningStreamer):
    """Deltas -> (reasoning delta, content delta): the reply re-read as messages after each
    delta (replies are short next to the step that made them), what grew handed out. A header
    is not read until its `<|message|>` arrives, so no marker leaks into the content."""

    def __init__(self, parser: GptOssReasoningParser) -> None:
        super().__init__(parser)
        self._reasoning = ""
        self._content = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        messages = parse_harmony(self.text)
        last = messages[-1] if messages else None
        if last is not None and not last.raw.endswith(("<|end|>", "<|call|>", "<|return|>")):
            held = _partial_marker(last.text)  # it may end in the first part of a marker
            if held:
                messages[-1] = replace(last, text=last.text[:-held])
        return self._advance(reasoning_of(messages), answer_of(messages))

    def finish(self) -> tuple[str, str]:
        messages = parse_harmony(self.text)
        return self._advance(reasoning_of(messages), answer_of(messages))

    def _advance(self, reasoning: str, content: str) -> tuple[str, str]:
        reasoning_delta = reasoning[len(self._reasoning) :]
        content_delta = content[len(self._content) :]
        self._reasoning, self._content = reasoning, content
        return reasoning_delta, content_delta


def _partial_marker(text: str) -> int:
    """How many trailing characters of `text` may begin a `<|...|>` marker."""
    start = text.rfind("<")
    return len(text) - start if start >= 0 and "|>" not in text[start:] else 0
