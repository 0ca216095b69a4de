"""The whole tool loop with the `openai` SDK against `tokenmill serve` and the demo model:
ask, get a call, run the tool here, send its result back, get the answer.

    tokenmill serve --served-model-name my-model --api-key sk-local \\
        --enable-auto-tool-choice --tool-call-parser hermes
    python examples/tool_calling/openai_sdk.py

The demo model learned this one tool (docs/demo_models.md): it cannot multiply, so it asks.
`TOKENMILL_URL` points it at another server (default http://127.0.0.1:8000).
"""

import json
import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("TOKENMILL_URL", "http://127.0.0.1:8000") + "/v1", api_key="sk-local"
)
tools = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiply two whole numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
messages = [{"role": "user", "content": "What is 1234 times 56?"}]
reply = client.chat.completions.create(
    model="my-model", messages=messages, tools=tools, temperature=0
)
message = reply.choices[0].message
messages.append(message)  # the assistant's turn, with its tool calls
for call in message.tool_calls or []:
    arguments = json.loads(call.function.arguments)
    result = arguments["a"] * arguments["b"]  # run the tool
    print(f"{call.function.name}({arguments}) -> {result}")
    messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
final = client.chat.completions.create(
    model="my-model", messages=messages, tools=tools, temperature=0
)
print(final.choices[0].message.content)
