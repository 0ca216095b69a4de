"""Chat stream chunks -> the Responses stream: `response.created`, `response.in_progress`, per
output item `response.output_item.added`, its deltas (`response.reasoning_text.delta`,
`response.output_text.delta` inside a content part, `response.function_call_arguments.delta`)
and their `.done` events, `response.output_item.done`; then `response.completed` (or
`response.incomplete`) with the whole response. Every event has a `sequence_number`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tokenmill.entrypoints.http.openai.protocol import ChatCompletionChunk, DeltaMessage
from tokenmill.entrypoints.http.responses.convert import (
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    response_call_id,
)


class ResponseEvents:
    def __init__(self, snapshot: Callable[[str, list[dict[str, Any]]], dict[str, Any]]) -> None:
        """`snapshot(status, output)`: the response object as it stands."""
        self.snapshot = snapshot
        self.output: list[dict[str, Any]] = []  # finished items
        self.finish_reason: str | None = None
        self.usage: Any = None
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self._text = ""

    def opening(self) -> list[str]:
        response = self.snapshot("in_progress", [])
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def events(self, chunk: ChatCompletionChunk) -> list[str]:
        if chunk.usage is not None:
            self.usage = chunk.usage
        events = []
        for choice in chunk.choices:
            events += self._delta_events(choice.delta)
            self.finish_reason = choice.finish_reason or self.finish_reason
        return events

    def closing(self) -> list[str]:
        events = self._close_item()
        status = "incomplete" if self.finish_reason == "length" else "completed"
        response = self.snapshot(status, self.output)
        return [*events, self._event(f"response.{status}", response=response)]

    def _delta_events(self, delta: DeltaMessage) -> list[str]:
        events = []
        if delta.reasoning_content:
            events += self._start("reasoning")
            self._text += delta.reasoning_content
            events.append(
                self._event(
                    "response.reasoning_text.delta",
                    **self._where(),
                    content_index=0,
                    delta=delta.reasoning_content,
                )
            )
        if delta.content:
            events += self._start("message")
            self._text += delta.content
            events.append(
                self._event(
                    "response.output_text.delta",
                    **self._where(),
                    content_index=0,
                    delta=delta.content,
                    logprobs=[],
                )
            )
        for call in delta.tool_calls or []:
            if call.id is not None:
                events += self._start("function_call", call.function.name or "", call.id)
            if call.function.arguments:
                self._text += call.function.arguments
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        **self._where(),
                        delta=call.function.arguments,
                    )
                )
        return events

    def _start(self, kind: str, name: str = "", chat_call_id: str = "") -> list[str]:
        if self._open is not None and self._open["type"] == kind and kind != "function_call":
            return []
        events = self._close_item()
        self._text = ""
        if kind == "reasoning":
            item = reasoning_item(new_id("rs"), "")
            item["content"], item["status"] = [], "in_progress"
        elif kind == "message":
            item = message_item(new_id("msg"), "", status="in_progress")
            item["content"] = []
        else:
            item = function_call_item(
                new_id("fc"), response_call_id(chat_call_id), name, "", "in_progress"
            )
        self._open = item
        events.append(
            self._event("response.output_item.added", output_index=len(self.output), item=item)
        )
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self._event(
                    "response.content_part.added", **self._where(), content_index=0, part=part
                )
            )
        return events

    def _close_item(self) -> list[str]:
        item, text = self._open, self._text
        if item is None:
            return []
        self._open = None
        where = {"item_id": item["id"], "output_index": len(self.output)}
        events = []
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text)
            events.append(
                self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
        elif item["type"] == "message":
            done = message_item(item["id"], text)
            part = done["content"][0]
            events.append(
                self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                )
            )
            events.append(
                self._event("response.content_part.done", **where, content_index=0, part=part)
            )
        else:
            done = function_call_item(item["id"], item["call_id"], item["name"], text)
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=text,
                )
            )
        events.append(
            self._event("response.output_item.done", output_index=len(self.output), item=done)
        )
        self.output.append(done)
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output)}

    def _event(self, event_type: str, **fields: Any) -> str:
        data = {"type": event_type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {event_type}\ndata: {json.dumps(data)}\n\n"
