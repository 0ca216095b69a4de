"""The key prefix-aware routing hashes: the start of a request's prompt.

The router hashes the prompt's first `num_chars` characters of text (for a prompt given as
token ids, its first `num_chars // 4` ids, about as many tokens), not the first blocks of
its token ids. The router then needs neither the model's tokenizer nor its chat template
(it fronts servers it knows only by URL, and stays a light process that does not compete
with the replicas for the CPU), and two prompts that share their first N characters share
their first ~N/4 tokens but for the token that straddles the boundary, which is all that
routing needs: the engine's own prefix cache, keyed by token blocks, decides what is reused.
"""

from __future__ import annotations

import json
from typing import Any

DEFAULT_PREFIX_CHARS = 512
CHARS_PER_TOKEN = 4


def prefix_key(path: str, body: bytes, num_chars: int = DEFAULT_PREFIX_CHARS) -> bytes | None:
    """The prefix key of a request to `path`, or None when it has no prompt to read (a body
    that is not JSON, or an unknown shape: the replica will answer that)."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(payload, dict):
        return None
    if path.endswith("/chat/completions"):
        key = _chat_key(payload.get("messages"), num_chars)
    else:
        key = _prompt_key(payload.get("prompt"), num_chars)
    salt = payload.get("cache_salt")
    if key is not None and isinstance(salt, str):  # salted prefixes are cached apart
        key = salt.encode() + b"\0" + key
    return key


def _prompt_key(prompt: Any, num_chars: int) -> bytes | None:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, str):
        return b"t" + prompt[:num_chars].encode()
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = prompt[: max(1, num_chars // CHARS_PER_TOKEN)]
        return b"i" + ",".join(map(str, ids)).encode()
    return None


def _chat_key(messages: Any, num_chars: int) -> bytes | None:
    if not isinstance(messages, list):
        return None
    text = ""
    for message in messages:
        if len(text) >= num_chars:
            break
        if isinstance(message, dict):
            text += f"<{message.get('role')}>{_content_text(message.get('content'))}"
    return b"c" + text[:num_chars].encode()


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text, in order
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return json.dumps(content)
