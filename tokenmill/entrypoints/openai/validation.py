"""Checks on a request body as a whole, before any field reaches the engine: text must be
valid Unicode, and one request may not ask for more sequences than `MAX_SEQUENCES`."""

from __future__ import annotations

from typing import Any

# Prompts x n one request may ask for: a client that leaves takes them all with it, and a
# queue of a million requests from one body starves everyone else.
MAX_SEQUENCES = 1024


class InvalidBodyError(ValueError):
    """Raised by request models' validators; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param


def check_unicode(data: Any) -> None:
    """Reject lone surrogates ("\\ud800", which JSON can spell) anywhere in the body: they are
    not Unicode text, cannot be encoded to UTF-8, and would fail the tokenizer, the prefix
    cache's hash or the log line far from here."""
    path = _first_unencodable(data, ())
    if path is not None:
        raise InvalidBodyError(
            ".".join(path), "contains a lone UTF-16 surrogate, which is not valid Unicode text"
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


def _first_unencodable(value: Any, path: tuple[str, ...]) -> tuple[str, ...] | None:
    if isinstance(value, str):
        return None if value.isascii() or _encodable(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not _encodable(key):
                return path
            found = _first_unencodable(item, (*path, str(key)))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, str | dict | list):
                found = _first_unencodable(item, (*path, str(index)))
                if found is not None:
                    return found
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
