"""Chat stream chunks -> Anthropic's event sequence: `message_start`, `ping`, then per content
block `content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`),
`content_block_stop`; `message_delta` (stop reason, output tokens) and `message_stop`. A
failure after the 200 is one `error` event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.entrypoints.http.anthropic.convert import stop_reason, tool_use_id
from tokenmill.entrypoints.http.anthropic.protocol import (
    AnthropicUsage,
    MessageResponse,
    TextContent,
    ToolUseContent,
)
from tokenmill.entrypoints.http.openai.protocol import ChatCompletionChunk, DeltaMessage

DELTA_USAGE_FIELDS = {
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens_details",
    "server_tool_use",
}


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n"


class MessageEvents:
    """The state of one streamed message: which block is open, how the reply ended."""

    def __init__(self, message_id: str, model: str, num_input_tokens: int) -> None:
        self.message_id = message_id
        self.model = model
        self.num_input_tokens = num_input_tokens
        self.num_output_tokens = 0
        self._block: str | None = None  # the open block's type
        self._index = -1
        self._finish: str | None = None
        self._matched: int | str | None = None

    def opening(self) -> list[str]:
        usage = AnthropicUsage(input_tokens=self.num_input_tokens, output_tokens=0)
        message = MessageResponse(
            id=self.message_id, model=self.model, content=[], stop_reason=None, usage=usage
        ).model_dump()
        return [sse("message_start", {"message": message}), sse("ping", {})]

    def events(self, chunk: ChatCompletionChunk) -> list[str]:
        if chunk.usage is not None:
            self.num_output_tokens = chunk.usage.completion_tokens
        events = []
        for choice in chunk.choices:
            events += self._delta_events(choice.delta)
            if choice.finish_reason is not None:
                self._finish, self._matched = choice.finish_reason, choice.stop_reason
        return events

    def closing(self) -> list[str]:
        events = self._close_block()
        reason, sequence = stop_reason(self._finish, self._matched)
        delta = {"stop_reason": reason, "stop_sequence": sequence, "stop_details": None}
        delta["container"] = None
        usage = AnthropicUsage(
            input_tokens=self.num_input_tokens, output_tokens=self.num_output_tokens
        ).model_dump(include=DELTA_USAGE_FIELDS)
        events.append(sse("message_delta", {"delta": delta, "usage": usage}))
        events.append(sse("message_stop", {}))
        return events

    def _delta_events(self, delta: DeltaMessage) -> list[str]:
        events = []
        if delta.reasoning_content:
            events += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(
                self._block_delta({"type": "thinking_delta", "thinking": delta.reasoning_content})
            )
        if delta.content:
            events += self._open("text", TextContent(text="").model_dump())
            events.append(self._block_delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or []:
            if call.id is not None:
                name = call.function.name or ""
                block = ToolUseContent(id=tool_use_id(call.id), name=name, input={})
                events += self._open("tool_use", block.model_dump(), always=True)
            if call.function.arguments:
                json_delta = {"type": "input_json_delta", "partial_json": call.function.arguments}
                events.append(self._block_delta(json_delta))
        return events

    def _open(self, kind: str, block: dict[str, Any], always: bool = False) -> list[str]:
        if self._block == kind and not always:
            return []
        events = self._close_block()
        self._block, self._index = kind, self._index + 1
        events.append(sse("content_block_start", {"index": self._index, "content_block": block}))
        return events

    def _block_delta(self, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"index": self._index, "delta": delta})

    def _close_block(self) -> list[str]:
        if self._block is None:
            return []
        self._block = None
        return [sse("content_block_stop", {"index": self._index})]


async def message_events(
    state: MessageEvents, chunks: AsyncIterator[ChatCompletionChunk], error_event: Any
) -> AsyncIterator[str]:
    for event in state.opening():
        yield event
    try:
        async for chunk in chunks:
            for event in state.events(chunk):
                yield event
    except Exception as e:
        yield error_event(e)
        return
    for event in state.closing():
        yield event
