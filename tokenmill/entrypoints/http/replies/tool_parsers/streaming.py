"""A parser's calls out of a stream of text deltas: text before a call streams as content at
once; a call goes out when the parser sees it whole, or when the reply ends. What the deltas
add up to is what the parser makes of the whole reply (`extract_tool_calls`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.entrypoints.http.replies.tool_parsers.base import ParsedCall, ToolParser


@dataclass
class StreamedPiece:
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallStreamer:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._num_sent = 0  # characters of text sent as content
        self._sent_content = False  # anything but whitespace sent
        self._region_start: int | None = None  # where the calls begin
        self._plain = False  # decided: this reply holds no calls
        self._calls: list[ParsedCall] = []

    def feed(self, delta: str) -> StreamedPiece:
        self.text += delta
        piece = StreamedPiece()
        if self._region_start is None:
            piece.content = self._content_until(self._safe_end())
        if self._region_start is not None:
            complete = self.parser.complete_calls(self.text[self._region_start :])
            piece.calls = self._new_calls(complete)
        return piece

    def finish(self) -> StreamedPiece:
        """What is left once the reply has ended."""
        if self._region_start is None:
            return StreamedPiece(content=self._content_until(len(self.text), final=True))
        result = self.parser.extract_tool_calls(self.text)
        if result.tools_called and result.calls[: len(self._calls)] == self._calls:
            return StreamedPiece(calls=self._new_calls(result.calls))
        # Not calls after all (malformed): the rest is text, as the whole reply would be.
        return StreamedPiece(content=self._content_until(len(self.text), final=True))

    @property
    def calls(self) -> list[ParsedCall]:
        return list(self._calls)

    def _new_calls(self, complete: list[ParsedCall]) -> list[ParsedCall]:
        new = complete[len(self._calls) :]
        self._calls.extend(new)
        return new

    def _content_until(self, end: int, final: bool = False) -> str:
        pending = self.text[self._num_sent : end]
        if not self._sent_content and not pending.strip() and not final:
            return ""  # whitespace before a call is no content (None in the whole reply)
        self._sent_content = True
        self._num_sent = end
        return pending

    def _safe_end(self) -> int:
        """How far the text is surely content; sets the region start when a call begins."""
        if self._plain:
            return len(self.text)
        if self.parser.calls_only_at_start:
            return self._safe_end_at_start()
        markers = self.parser.start_markers
        found = [i for i in (self.text.find(m) for m in markers) if i >= 0]
        if found:
            self._region_start = min(found)
            return self._region_start
        held = max((_partial_suffix(self.text, m) for m in markers), default=0)
        return len(self.text) - held

    def _safe_end_at_start(self) -> int:
        stripped = self.text.lstrip()
        if not stripped:
            return self._num_sent
        offset = len(self.text) - len(stripped)
        if any(stripped.startswith(m) for m in self.parser.start_markers):
            self._region_start = offset
            return offset
        if any(m.startswith(stripped) for m in self.parser.start_markers):
            return self._num_sent  # maybe a marker still arriving
        self._plain = True
        return len(self.text)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (it may be arriving)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
