"""One training or eval document of the demo corpus, and the chat it stands for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]  # a chat message in OpenAI's shape


@dataclass(frozen=True)
class Example:
    """One document: a chat turn (`prompt` is the user's message) or plain text (`prompt=None`).

    A tool chat also offers `tools` (function tools in OpenAI's shape) and may go on after the
    user's message with `turns` (the assistant's call, the tool's result): `answer` is then the
    reply to the last of them.
    """

    task: str
    prompt: str | None
    answer: str
    system: str | None = None  # an optional system message before the user's
    tools: tuple[dict[str, Any], ...] = ()
    turns: tuple[Message, ...] = ()

    def messages(self) -> list[Message]:
        """The chat up to the reply, as a client sends it."""
        if self.prompt is None:
            raise ValueError("a plain-text document has no chat")
        system = [{"role": "system", "content": self.system}] if self.system is not None else []
        return [*system, {"role": "user", "content": self.prompt}, *self.turns]
