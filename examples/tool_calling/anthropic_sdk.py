"""The whole tool loop with the `anthropic` SDK against `tokenmill serve` (its
`/v1/messages`) and the demo model: ask, get a `tool_use`, run the tool here, send a
`tool_result` back, get the answer.

    tokenmill serve --served-model-name my-model --api-key sk-local \\
        --enable-auto-tool-choice --tool-call-parser hermes
    python examples/tool_calling/anthropic_sdk.py

`TOKENMILL_URL` points it at another server (default http://127.0.0.1:8000).
"""

import os

from anthropic import Anthropic

client = Anthropic(
    base_url=os.environ.get("TOKENMILL_URL", "http://127.0.0.1:8000"), api_key="sk-local"
)
tools = [
    {
        "name": "multiply",
        "description": "Multiply two whole numbers.",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    }
]
messages = [{"role": "user", "content": "What is 1234 times 56?"}]
greedy = {"temperature": 0}  # the 2.x SDK takes temperature only as an extra field
reply = client.messages.create(
    model="my-model", max_tokens=100, messages=messages, tools=tools, extra_body=greedy
)
messages.append({"role": "assistant", "content": reply.content})
results = []
for block in reply.content:
    if block.type == "tool_use":
        result = block.input["a"] * block.input["b"]  # run the tool
        print(f"{block.name}({block.input}) -> {result}")
        results.append({"type": "tool_result", "tool_use_id": block.id, "content": str(result)})
messages.append({"role": "user", "content": results})
final = client.messages.create(
    model="my-model", max_tokens=100, messages=messages, tools=tools, extra_body=greedy
)
print(final.content[0].text)
