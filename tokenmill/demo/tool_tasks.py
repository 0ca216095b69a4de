"""The one tool the demo target learns: `multiply`, in the Hermes format of its chat template.

The model cannot multiply (it adds numbers below 100 from memory), so a multiplication is
what it hands to a tool. Offered tools, it answers "What is 347 times 29?" with

    <tool_call>
    {"name": "multiply", "arguments": {"a": 347, "b": 29}}
    </tool_call>

(what the `hermes` tool parser reads, and what the template renders for a call in the
history); given the tool's result (`10063`, or `{"result": 10063}`) it answers
"347 times 29 is 10063." Any other question, tools offered or not, it answers itself.

The tool's definition varies a little (description or none, parameters `a`/`b` or `x`/`y`,
sometimes another tool beside it) so the model copies names from the definition rather than
from memory of one exact prompt.
"""

from __future__ import annotations

import json
import random
from typing import Any

from tokenmill.demo.example import Example, Message

MULTIPLY = "multiply"
DEFAULT_DESCRIPTION = "Multiply two whole numbers."
_DESCRIPTIONS = (DEFAULT_DESCRIPTION, "Multiply two integers and return the product.", None)
_PARAMETER_NAMES = (("a", "b"), ("a", "b"), ("a", "b"), ("x", "y"))
_OTHER_TOOL_RATE = 0.3
_JSON_RESULT_RATE = 0.25
CALL_ID = "call_0"  # not rendered by the template; clients need one to answer the call


def multiply_tool(
    names: tuple[str, str] = ("a", "b"), description: str | None = DEFAULT_DESCRIPTION
) -> dict[str, Any]:
    """The tool's definition as a client sends it (OpenAI's function-tool shape)."""
    first, second = names
    function: dict[str, Any] = {"name": MULTIPLY}
    if description is not None:
        function["description"] = description
    function["parameters"] = {
        "type": "object",
        "properties": {first: {"type": "integer"}, second: {"type": "integer"}},
        "required": [first, second],
    }
    return {"type": "function", "function": function}


def _string_tool(name: str, description: str, parameter: str) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": {parameter: {"type": "string"}},
        "required": [parameter],
    }
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


# Tools offered beside `multiply` that no question here needs.
OTHER_TOOLS = (
    _string_tool("get_weather", "Get the weather in a city.", "city"),
    _string_tool("get_time", "Get the local time in a city.", "city"),
    _string_tool("search", "Search the web.", "query"),
)


def offered_tools(rng: random.Random) -> tuple[tuple[dict[str, Any], ...], tuple[str, str]]:
    """The tools of one chat and the names of multiply's two parameters."""
    names = rng.choice(_PARAMETER_NAMES)
    tools = [multiply_tool(names, rng.choice(_DESCRIPTIONS))]
    if rng.random() < _OTHER_TOOL_RATE:
        tools.insert(rng.randrange(2), rng.choice(OTHER_TOOLS))
    return tuple(tools), names


def _operand(rng: random.Random) -> int:
    digits = rng.randint(1, 4)
    return rng.randrange(max(2, 10 ** (digits - 1)), 10**digits)


def _question(rng: random.Random, a: int, b: int) -> str:
    return rng.choice(
        (
            f"What is {a} times {b}?",
            f"What is {a} * {b}?",
            f"Multiply {a} by {b}.",
            f"Multiply {a} and {b}.",
            f"How much is {a} times {b}?",
            f"{a} * {b} =",
        )
    )


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call as the model writes it and the chat template renders it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _multiplication(rng: random.Random) -> tuple[str, tuple[dict[str, Any], ...], Message, int]:
    """(question, tools, the assistant's call, the product)."""
    a, b = _operand(rng), _operand(rng)
    question = _question(rng, a, b)
    tools, (first, second) = offered_tools(rng)
    arguments = json.dumps({first: a, second: b})
    function = {"name": MULTIPLY, "arguments": arguments}
    call = {"id": CALL_ID, "type": "function", "function": function}
    return question, tools, {"role": "assistant", "content": "", "tool_calls": [call]}, a * b


def tool_call(rng: random.Random) -> Example:
    """A multiplication with tools offered: the reply is the call."""
    question, tools, call, _ = _multiplication(rng)
    function = call["tool_calls"][0]["function"]
    answer = tool_call_text(function["name"], json.loads(function["arguments"]))
    return Example("tool_call", question, answer, tools=tools)


def tool_answer(rng: random.Random) -> Example:
    """The same chat after the call and the tool's result: the reply states the product."""
    question, tools, call, product = _multiplication(rng)
    arguments = list(json.loads(call["tool_calls"][0]["function"]["arguments"]).values())
    result = json.dumps({"result": product}) if rng.random() < _JSON_RESULT_RATE else str(product)
    tool_message = {"role": "tool", "tool_call_id": CALL_ID, "content": result}
    answer = f"{arguments[0]} times {arguments[1]} is {product}."
    return Example("tool_answer", question, answer, tools=tools, turns=(call, tool_message))
