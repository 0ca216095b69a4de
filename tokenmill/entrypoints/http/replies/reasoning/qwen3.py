"""Qwen3: reasoning only inside `<think>...</think>` at the start of the reply; a reply without
both tags (thinking off, `enable_thinking: false`) is all content."""

from __future__ import annotations

from tokenmill.entrypoints.http.replies.reasoning.base import (
    ReasoningParser,
    ReasoningSplit,
    register_reasoning_parser,
)


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    def split(self, text: str) -> ReasoningSplit:
        stripped = text.lstrip()
        if not stripped.startswith(self.start_tag) or self.end_tag not in stripped:
            return ReasoningSplit(None, text or None)
        reasoning, _, content = stripped[len(self.start_tag) :].partition(self.end_tag)
        return ReasoningSplit(reasoning or None, content or None)

    def starts_in_reasoning(self, text: str) -> bool | None:
        stripped = text.lstrip()
        if stripped.startswith(self.start_tag):
            return True
        if not stripped or self.start_tag.startswith(stripped):
            return None
        return False
