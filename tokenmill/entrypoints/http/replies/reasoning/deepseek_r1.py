"""DeepSeek-R1: the template opens `<think>` in the prompt, so a reply is reasoning until
`</think>` (a `<think>` the model writes itself is dropped); a reply that never closes it is
all reasoning."""

from __future__ import annotations

from tokenmill.entrypoints.http.replies.reasoning.base import (
    ReasoningParser,
    ReasoningSplit,
    register_reasoning_parser,
)


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    def split(self, text: str) -> ReasoningSplit:
        stripped = text.lstrip()
        if stripped.startswith(self.start_tag):
            text = stripped[len(self.start_tag) :]
        reasoning, found, content = text.partition(self.end_tag)
        if not found:
            return ReasoningSplit(text or None, None)
        return ReasoningSplit(reasoning or None, content or None)

    def starts_in_reasoning(self, text: str) -> bool | None:
        stripped = text.lstrip()
        if not stripped or (self.start_tag.startswith(stripped) and stripped != self.start_tag):
            return None  # wait: the model may be writing a `<think>` of its own
        return True
