"""What every tool-call parser is: model text in, calls (name + JSON arguments) and leftover
content out. A parser never raises on what a model wrote: text it cannot read as calls stays
content, as vLLM's parsers do.

Streaming needs one more thing from a parser: where its calls may begin (`start_markers`), so
that text before a call streams as content at once and the call itself is held until it is
whole (`complete_calls`).
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass
class ExtractedToolCalls:
    calls: list[ParsedCall] = field(default_factory=list)
    content: str | None = None  # the text that is not a call (None when there is none)

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)


class ToolParser(ABC):
    """Reads one model family's way of writing calls."""

    # Where calls may begin. `calls_only_at_start`: a reply is either calls (after optional
    # whitespace, starting with a marker) or plain text, never text then calls.
    start_markers: tuple[str, ...] = ()
    calls_only_at_start: bool = False
    # Its markers are special tokens: replies are decoded with them (gpt-oss's harmony).
    keeps_special_tokens = False

    @abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls in a finished reply; no calls and the text as content when it has none or
        they do not parse."""

    def complete_calls(self, region: str) -> list[ParsedCall]:
        """While streaming, the calls already whole in `region` (the text from the first
        marker on). By default nothing is whole until the reply ends."""
        return []

    def make_call_id(self) -> str:
        return f"chatcmpl-tool-{secrets.token_hex(16)}"


def arguments_json(arguments: Any) -> str | None:
    """A call's arguments as JSON text of an object: an object as it is, a string holding one
    as that string re-serialized; None for anything else (not a call then)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def call_from_object(value: Any, argument_keys: tuple[str, ...] = ("arguments",)) -> ParsedCall:
    """`{"name": ..., "arguments": {...}}` -> a call; ValueError if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise ValueError("not a call object")
    key = next((k for k in argument_keys if k in value), None)
    arguments = arguments_json(value[key]) if key is not None else "{}"
    if arguments is None or not value["name"]:
        raise ValueError("a call's arguments must be an object")
    return ParsedCall(value["name"], arguments)


def random_alphanumeric(length: int) -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """Class decorator: `--tool-call-parser NAME` picks the class."""

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        _PARSERS[name] = cls
        return cls

    return register


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; one of {tool_parser_names()}")
    return _PARSERS[name]()
