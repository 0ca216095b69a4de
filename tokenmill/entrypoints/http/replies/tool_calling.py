"""A chat request's `tools` and `tool_choice` -> what the reply may be, as vLLM decides it.

- `none` (or no tools): plain text; the tools still reach the chat template, as in vLLM.
- `auto`: the model writes calls its own way; `--tool-call-parser` reads them out of the text
  (refused without `--enable-auto-tool-choice` and a parser, as vLLM refuses it).
- `required`: the reply is constrained (structured outputs) to a JSON array of
  `{"name", "parameters"}` whose items match one tool each (one item without
  `parallel_tool_calls`). The array ends when the model closes it (vLLM's schema): one cut
  short keeps its whole calls.
- a named function: the reply is constrained to that function's arguments.

The engine never hears of tools: it sees a prompt and, for the last two, a JSON schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill.entrypoints.http.openai.protocol import (
    ChatCompletionRequest,
    ChatTool,
    NamedToolChoice,
)
from tokenmill.entrypoints.http.replies.tool_parsers import (
    ExtractedToolCalls,
    ParsedCall,
    ToolParser,
)
from tokenmill.entrypoints.http.transport.errors import bad_request
from tokenmill.structured_output import StructuredOutputsParams

ToolMode = Literal["none", "auto", "required", "named"]
NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request's reply relates to its tools."""

    mode: ToolMode
    function_name: str | None = None  # the named function
    constraint: StructuredOutputsParams | None = None
    parser: ToolParser | None = None  # auto only

    def parse(self, text: str) -> ExtractedToolCalls:
        """A finished reply (after any reasoning) as calls and content."""
        if self.mode == "named":
            assert self.function_name is not None
            if not text:  # the reply ended before its arguments (in its reasoning, say)
                return ExtractedToolCalls()
            return ExtractedToolCalls([ParsedCall(self.function_name, text)])
        if self.mode == "required":
            return _required_calls(text)
        if self.mode == "auto" and self.parser is not None:
            return self.parser.extract_tool_calls(text)
        return ExtractedToolCalls(content=text)


def plan_tools(
    request: ChatCompletionRequest, enable_auto_tool_choice: bool, parser: ToolParser | None
) -> ToolPlan:
    """The request's plan; a 400 for a tool_choice the tools or the server cannot honour."""
    tools, choice = request.tools or [], request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    _check_unique_names(tools)
    if choice == "none":
        return ToolPlan("none")
    if choice == "auto":
        if not (enable_auto_tool_choice and parser is not None):
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set",
                param="tool_choice",
            )
        return ToolPlan("auto", parser=parser)
    if request.response_format is not None or request.structured_outputs is not None:
        raise bad_request(
            "tool_choice 'required' or a named function cannot be combined with "
            "response_format or structured_outputs (one output constraint per request)",
            param="tool_choice",
        )
    if choice == "required":
        schema = _required_schema(tools, bool(request.parallel_tool_calls))
        return ToolPlan("required", constraint=_constraint(schema))
    assert isinstance(choice, NamedToolChoice)
    tool = next((t for t in tools if t.function.name == choice.function.name), None)
    if tool is None:
        raise bad_request(
            f"Tool '{choice.function.name}' has not been passed in `tools`.",
            param="tool_choice",
        )
    return ToolPlan(
        "named", tool.function.name, _constraint(tool.function.parameters or NO_ARGUMENTS)
    )


def template_tools(request: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (OpenAI's shape, as dicts)."""
    if not request.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in request.tools]


def _check_unique_names(tools: list[ChatTool]) -> None:
    """One pass with a set (a `count` per name was quadratic: 40,000 tools took 40 s)."""
    seen: set[str] = set()
    for tool in tools:
        name = tool.function.name
        if name in seen:
            raise bad_request(f"tools has two functions named {name!r}", param="tools")
        seen.add(name)


def _required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or NO_ARGUMENTS,
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _constraint(schema: dict[str, Any]) -> StructuredOutputsParams:
    # Compact, as OpenAI's calls are: free whitespace lets a small model pad to max_tokens.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True, param="tools")


def _required_calls(text: str) -> ExtractedToolCalls:
    """The constrained array's calls. A reply cut short (max_tokens, a stop string) keeps the
    calls it wrote whole, as a stream would have sent them; with none whole it stays text."""
    try:
        items = _whole_items(text)
        calls = [
            ParsedCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            for item in items
        ]
    except (ValueError, TypeError, KeyError, RecursionError):
        return ExtractedToolCalls(content=text)
    if not calls:
        return ExtractedToolCalls(content=text)
    return ExtractedToolCalls(calls)


_JSON = json.JSONDecoder()
_WHITESPACE = " \t\n\r"


def _whole_items(text: str) -> list[Any]:
    """The items of the JSON array `text` starts, up to the first one cut short; ValueError
    if it is not an array, or if anything follows its `]`."""
    index = _skip_whitespace(text, 0)
    if not text.startswith("[", index):
        raise ValueError("not a JSON array")
    items: list[Any] = []
    index = _skip_whitespace(text, index + 1)
    while index < len(text) and text[index] != "]":
        try:
            item, index = _JSON.raw_decode(text, index)
        except ValueError:
            return items  # cut inside this item
        items.append(item)
        index = _skip_whitespace(text, index)
        if text.startswith(",", index):
            index = _skip_whitespace(text, index + 1)
        elif not text.startswith("]", index) and index < len(text):
            raise ValueError("not a JSON array")
    if index < len(text) and text[index + 1 :].strip(_WHITESPACE):
        raise ValueError("text after the array")
    return items


def _skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in _WHITESPACE:
        index += 1
    return index
