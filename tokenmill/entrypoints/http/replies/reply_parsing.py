"""A chat reply's text -> reasoning, content and tool calls, whole (`parse_reply`) or delta by
delta (`ReplyStream`): the registries' parsers between the engine's output stream and the
protocol adapters. Every adapter (chat, messages, responses) reads replies through here."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from tokenmill.entrypoints.http.openai.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ResponseFunctionCall,
    ResponseToolCall,
)
from tokenmill.entrypoints.http.replies.reasoning import ReasoningParser, get_reasoning_parser
from tokenmill.entrypoints.http.replies.tool_calling import ToolPlan
from tokenmill.entrypoints.http.replies.tool_parsers import (
    ExtractedToolCalls,
    ParsedCall,
    ToolParser,
    get_tool_parser,
)
from tokenmill.entrypoints.http.replies.tool_parsers.streaming import (
    StreamedPiece,
    ToolCallStreamer,
)


@dataclass(frozen=True)
class ReplyParsing:
    """The server's flags: `--enable-auto-tool-choice`, `--tool-call-parser`,
    `--reasoning-parser` (names checked at start-up by `check`)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def check(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
        self.tool_parser()
        self.reasoning()

    def tool_parser(self) -> ToolParser | None:
        return None if self.tool_call_parser is None else get_tool_parser(self.tool_call_parser)

    def reasoning(self) -> ReasoningParser | None:
        name = self.reasoning_parser
        return None if name is None else get_reasoning_parser(name)


def reply_parsing_from_args(args: argparse.Namespace) -> ReplyParsing:
    options = ReplyParsing(
        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
        tool_call_parser=getattr(args, "tool_call_parser", None),
        reasoning_parser=getattr(args, "reasoning_parser", None),
    )
    options.check()
    return options


@dataclass
class ParsedReply:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] = field(default_factory=list)


def keeps_special_tokens(plan: ToolPlan, reasoning: ReasoningParser | None) -> bool:
    """Whether the reply must be decoded with its special tokens for the parsers to read it
    (gpt-oss's harmony markers)."""
    tools = plan.parser is not None and plan.parser.keeps_special_tokens
    return tools or (reasoning is not None and reasoning.keeps_special_tokens)


def parse_reply(text: str, plan: ToolPlan, reasoning: ReasoningParser | None) -> ParsedReply:
    if reasoning is None and plan.mode == "none":
        return ParsedReply(text)  # as it was written, "" included
    reasoning_text, content = None, text
    if reasoning is not None:
        split = reasoning.split(text)
        reasoning_text, content = split.reasoning, split.content or ""
    if plan.mode == "none":
        return ParsedReply(content or None, reasoning_text)
    extracted = plan.parse(content)
    if not extracted.tools_called:
        return ParsedReply(extracted.content or None, reasoning_text)
    calls = [_tool_call(plan, call) for call in extracted.calls]
    return ParsedReply(extracted.content, reasoning_text, calls)


def _tool_call(plan: ToolPlan, call: ParsedCall) -> ResponseToolCall:
    function = ResponseFunctionCall(name=call.name, arguments=call.arguments)
    return ResponseToolCall(id=_call_id(plan), function=function)


def _call_id(plan: ToolPlan) -> str:
    return (plan.parser or _DEFAULT_IDS).make_call_id()


class _RequiredArray(ToolParser):
    """`tool_choice: required`: the constrained JSON array, read when the reply ends."""

    start_markers = ("[",)
    calls_only_at_start = True

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        return self.plan.parse(text)


_DEFAULT_IDS = _RequiredArray(ToolPlan("required"))


class ReplyStream:
    """One choice's deltas -> `DeltaMessage`s: reasoning, content, and each call as a delta
    with its id and name followed by one with its arguments."""

    def __init__(self, plan: ToolPlan, reasoning: ReasoningParser | None) -> None:
        self.plan = plan
        self._reasoning = None if reasoning is None else reasoning.streamer()
        self._tools: ToolCallStreamer | None = None
        if plan.mode == "auto" and plan.parser is not None:
            self._tools = ToolCallStreamer(plan.parser)
        elif plan.mode == "required":
            self._tools = ToolCallStreamer(_RequiredArray(plan))
        self._named_opened = False
        self.num_calls = 0

    @property
    def tools_called(self) -> bool:
        return self.num_calls > 0

    def feed(self, delta: str) -> list[DeltaMessage]:
        reasoning, content = self._reasoning.feed(delta) if self._reasoning else ("", delta)
        return self._messages(reasoning, content, final=False)

    def finish(self) -> list[DeltaMessage]:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._messages(reasoning, content, final=True)

    def _messages(self, reasoning: str, content: str, final: bool) -> list[DeltaMessage]:
        messages = [DeltaMessage(reasoning_content=reasoning)] if reasoning else []
        if self.plan.mode == "named":
            return messages + self._named_deltas(content)
        if self._tools is None:
            return messages + ([DeltaMessage(content=content)] if content else [])
        piece = self._tools.feed(content)
        if final:
            rest = self._tools.finish()
            piece = StreamedPiece(piece.content + rest.content, piece.calls + rest.calls)
        if piece.content:
            messages.append(DeltaMessage(content=piece.content))
        for call in piece.calls:
            messages.extend(self._call_deltas(call))
        return messages

    def _call_deltas(self, call: ParsedCall) -> list[DeltaMessage]:
        index, self.num_calls = self.num_calls, self.num_calls + 1
        opening = DeltaToolCall(
            index=index,
            id=_call_id(self.plan),
            type="function",
            function=DeltaFunctionCall(name=call.name, arguments=""),
        )
        arguments = DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments))
        return [DeltaMessage(tool_calls=[opening]), DeltaMessage(tool_calls=[arguments])]

    def _named_deltas(self, content: str) -> list[DeltaMessage]:
        """The named function's arguments stream as the model writes them."""
        messages = []
        if not self._named_opened and content:
            self._named_opened = True
            messages.extend(self._call_deltas(ParsedCall(self.plan.function_name or "", ""))[:1])
        if content:
            fragment = DeltaFunctionCall(arguments=content)
            messages.append(DeltaMessage(tool_calls=[DeltaToolCall(index=0, function=fragment)]))
        return messages
