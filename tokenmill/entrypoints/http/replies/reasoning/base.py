"""Reasoning parsers: a reply's thinking (`<think>...</think>`) apart from its answer, whole
or delta by delta. `--reasoning-parser NAME` picks one; the answer is what tool parsing and
the client's `content` see."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class ReasoningSplit:
    reasoning: str | None
    content: str | None


class ReasoningParser(ABC):
    start_tag = "<think>"
    end_tag = "</think>"
    # Its markers are special tokens: replies are decoded with them (gpt-oss's harmony).
    keeps_special_tokens = False

    @abstractmethod
    def split(self, text: str) -> ReasoningSplit:
        """A finished reply's reasoning and content (None for an empty part)."""

    @abstractmethod
    def starts_in_reasoning(self, text: str) -> bool | None:
        """While streaming: whether the reply begins with reasoning, from its first
        characters; None while they do not tell yet."""

    def ended_in_prompt(self, prompt: str) -> bool:
        """The prompt closed the reasoning itself (Qwen3's template with thinking off ends
        with `<think>\n\n</think>\n\n`): a constrained reply is constrained from its first
        token. Otherwise the constraint waits for the reply's `end_tag`, as vLLM's grammar
        waits for its reasoning parser's end token."""
        return prompt.rstrip().endswith(self.end_tag)

    def streamer(self) -> ReasoningStreamer:
        """What splits the reply delta by delta."""
        return ReasoningStreamer(self)


class ReasoningStreamer:
    """Deltas -> (reasoning delta, content delta); a tag split across deltas is held back."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self._state: str = "undecided"  # then "reasoning" or "content"
        self._num_used = 0  # characters of text already handed out (or dropped as tags)

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        if self._state == "undecided":
            begins = self.parser.starts_in_reasoning(self.text)
            if begins is None:
                return "", ""
            self._state = "reasoning" if begins else "content"
            if begins and self.text.lstrip().startswith(self.parser.start_tag):
                tag_at = self.text.index(self.parser.start_tag)
                self._num_used = tag_at + len(self.parser.start_tag)
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        if self._state == "undecided":
            self._state = "content"
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self._state == "reasoning":
            end = self.text.find(self.parser.end_tag, self._num_used)
            if end < 0:
                held = 0 if final else _partial_suffix(self.text, self.parser.end_tag)
                reasoning = self.text[self._num_used : len(self.text) - held]
                self._num_used = len(self.text) - held
                return reasoning, ""
            reasoning = self.text[self._num_used : end]
            self._num_used = end + len(self.parser.end_tag)
            self._state = "content"
        content = self.text[self._num_used :]
        self._num_used = len(self.text)
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(
    name: str,
) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        _PARSERS[name] = cls
        return cls

    return register


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; one of {reasoning_parser_names()}")
    return _PARSERS[name]()
