"""Checks on a request body as a whole, before any field reaches the engine: text must be
valid Unicode, objects and arrays nest at most `MAX_JSON_DEPTH` deep, one request may not ask
for more sequences than `MAX_SEQUENCES` nor carry more tools than `MAX_TOOLS`. Each check is
one linear pass without recursion: a body is up to 2 MiB of anything a client chose."""

from __future__ import annotations

from typing import Any

from tokenmill.sampling_params import json_depth

# Prompts x n one request may ask for: a client that leaves takes them all with it, and a
# queue of a million requests from one body starves everyone else.
MAX_SEQUENCES = 1024
# Tools in one request: OpenAI allows 128; this is generous, yet keeps the tools' checks, the
# chat template and a `required` constraint over them cheap (40,000 froze the server).
MAX_TOOLS = 1024
# Objects and arrays inside one another anywhere in a body, or in a tool call's `arguments`
# text: deeper ones are refused before anything recursive (the chat template's `tojson`,
# Python's json) sees them.
MAX_JSON_DEPTH = 128


class InvalidBodyError(ValueError):
    """Raised by request models' validators; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


def check_unicode(data: Any) -> None:
    """Reject lone surrogates ("\\ud800", which JSON can spell) anywhere in the body: they are
    not Unicode text, cannot be encoded to UTF-8, and would fail the tokenizer, the prefix
    cache's hash or the log line far from here. Nesting deeper than `MAX_JSON_DEPTH` is
    refused in the same pass."""
    if not isinstance(data, dict | list | str):
        return
    problem = _first_problem(data)
    if problem is not None:
        path, message = problem
        raise InvalidBodyError(".".join(path), message)


def check_json_depth(value: Any, param: str) -> None:
    """`value` (parsed JSON) nests objects and arrays at most `MAX_JSON_DEPTH` deep."""
    if json_depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise InvalidBodyError(param, _too_deep())


def check_num_tools(tools: Any, param: str = "tools") -> None:
    """At most `MAX_TOOLS` tools, counted before any of them is validated."""
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise InvalidBodyError(
            param, f"{len(tools)} tools given; at most {MAX_TOOLS} are allowed per request"
        )


def check_num_sequences(prompt: Any, n: Any) -> None:
    """A completions body's prompts x n, counted before the prompts are validated one by one
    (validating a million of them would itself stall the server)."""
    num_prompts = len(prompt) if isinstance(prompt, list) and prompt else 1
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        num_prompts = 1  # one prompt as token ids
    num_samples = n if isinstance(n, int) and n > 0 else 1
    if num_prompts * num_samples > MAX_SEQUENCES:
        raise InvalidBodyError(
            "prompt",
            f"{num_prompts} prompts x n={num_samples} asks for "
            f"{num_prompts * num_samples} sequences; at most {MAX_SEQUENCES} per request",
        )


def _first_problem(data: Any) -> tuple[tuple[str, ...], str] | None:
    """The path to the first lone surrogate or too-deep nesting, and what is wrong there.
    Iterative: each stack entry is (container, its depth, its parent entry, its key), so a
    path is built only for the one problem found; strings are checked in place."""
    if isinstance(data, str):
        return None if data.isascii() or _encodable(data) else ((), _SURROGATE)
    stack: list[tuple[Any, int, Any, str | None]] = [(data, 0, None, None)]
    while stack:
        entry = stack.pop()
        value, depth = entry[0], entry[1]
        if depth >= MAX_JSON_DEPTH:
            return _path(entry)[:1], _too_deep()  # the top-level field; not 128 keys
        pairs = value.items() if isinstance(value, dict) else enumerate(value)
        children = []
        for key, item in pairs:
            if isinstance(key, str) and not _encodable(key):
                return _path(entry), _SURROGATE
            if isinstance(item, str):
                if not (item.isascii() or _encodable(item)):
                    return (*_path(entry), str(key)), _SURROGATE
            elif isinstance(item, dict | list):
                children.append((item, depth + 1, entry, str(key)))
        stack.extend(reversed(children))  # depth first, in order
    return None


_SURROGATE = "contains a lone UTF-16 surrogate, which is not valid Unicode text"


def _too_deep() -> str:
    return f"nests objects and arrays more than {MAX_JSON_DEPTH} levels deep"


def _path(entry: tuple[Any, int, Any, str | None]) -> tuple[str, ...]:
    keys: list[str] = []
    while entry is not None and entry[3] is not None:
        keys.append(entry[3])
        entry = entry[2]
    return tuple(reversed(keys))


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
