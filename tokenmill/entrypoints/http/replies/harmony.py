"""gpt-oss's harmony format, read from a reply's text (special tokens kept): messages of
`<|start|>{role}[ to={recipient}]<|channel|>{channel}[ to={recipient}][ <|constrain|>{type}]
<|message|>{text}` ending in `<|end|>`, `<|call|>` (a tool call) or `<|return|>` (the answer).
The reply begins inside the prompt's `<|start|>assistant` header. Channels: `analysis` (the
reasoning), `commentary` (tool calls, addressed `to=functions.NAME`, and preambles), `final`
(the answer).

The `openai-harmony` package would render and parse this from token ids, but it loads the
o200k_base vocabulary from the network on first use, which servers without internet access
cannot (docs/moe.md, "gpt-oss"); the format is small enough to read here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MESSAGE = "<|message|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_HEADER_START = re.compile(r"<\|start\|>|<\|channel\|>|\bto=")
# Tokens that mark harmony text: a reply without them is plain text (the final answer).
SPECIAL_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>")


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str  # analysis, commentary, final; "final" for text outside any message
    text: str
    recipient: str | None = None  # e.g. "functions.get_weather"
    raw: str = ""  # the message as written, header included

    @property
    def function(self) -> str | None:
        """The function this message calls, if it is a tool call."""
        if self.recipient is None or not self.recipient.startswith("functions."):
            return None
        return self.recipient.removeprefix("functions.")


def parse_harmony(text: str) -> list[HarmonyMessage]:
    """The messages of `text` in order, the last one possibly unfinished; text before a
    header, or a reply without any, is a `final` message of its own."""
    messages: list[HarmonyMessage] = []
    position = 0
    while position < len(text):
        body = text.find(MESSAGE, position)
        if body < 0:  # an unfinished header, or plain text
            rest = text[position:]
            if not any(token in rest for token in SPECIAL_TOKENS) and rest.strip():
                messages.append(HarmonyMessage("final", rest, raw=rest))
            break
        header = text[position:body]
        lead = _HEADER_START.search(header)
        if lead is not None and lead.start() > 0 and header[: lead.start()].strip():
            plain = header[: lead.start()]
            messages.append(HarmonyMessage("final", plain, raw=plain))
            position += lead.start()
            header = header[lead.start() :]
        start = body + len(MESSAGE)
        ends = [i for i in (text.find(end, start) for end in _ENDS) if i >= 0]
        end = min(ends, default=len(text))
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        terminator = next((t for t in _ENDS[:3] if text.startswith(t, end)), "")
        messages.append(
            HarmonyMessage(
                channel.group(1) if channel else "final",
                text[start:end],
                recipient.group(1) if recipient else None,
                text[position : end + len(terminator)],
            )
        )
        position = end + len(terminator)
    return messages


def reasoning_of(messages: list[HarmonyMessage]) -> str:
    return "".join(m.text for m in messages if m.channel == "analysis")


def answer_of(messages: list[HarmonyMessage]) -> str:
    """What is not reasoning, in order: answers and preambles as their text, tool calls as
    written (for a tool parser to read)."""
    return "".join(
        m.raw if m.function is not None else m.text for m in messages if m.channel != "analysis"
    )
