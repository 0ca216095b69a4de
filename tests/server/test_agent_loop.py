"""An agent framework (openai-agents, unmodified) completes a multi-step tool loop against a
real `tokenmill serve` with the demo model, over the Responses API and over chat completions:
step 1 must call the tool (tool_choice "required": a valid call even from this small model,
given a bounded argument: in a free string it would write on to max_tokens),
the tool runs, its result goes back, and step 2 (tool choice back to "auto", as the framework
resets it) answers in text."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Literal

import pytest
from server_clients import async_openai_client
from server_utils import Server, start_server, stop_server

from tokenmill.demo import DEMO_TARGET_NAME

agents = pytest.importorskip("agents")


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("agents") / "server.log"
    args = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-model-len", "1024")
    server = start_server(None, log_path, *args)
    yield server
    stop_server(server)


def _run_agent(server: Server, api: str) -> tuple[list[dict], object]:
    agents.set_tracing_disabled(True)  # nothing leaves the machine
    client = async_openai_client(server)
    model_class = {
        "responses": agents.OpenAIResponsesModel,
        "chat": agents.OpenAIChatCompletionsModel,
    }[api]
    calls: list[dict] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather forecast for a city."""
        calls.append({"city": city})
        return f"It is sunny in {city}."

    agent = agents.Agent(
        name="weather",
        instructions="Answer with the tools.",
        tools=[get_weather],
        model=model_class(model=DEMO_TARGET_NAME, openai_client=client),
        model_settings=agents.ModelSettings(
            tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0.0
        ),
    )
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    return calls, result


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_agent_completes_a_tool_loop(agent_server: Server, api: str) -> None:
    calls, result = _run_agent(agent_server, api)
    assert len(calls) >= 1 and all(c["city"] in ("Paris", "Rome") for c in calls)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert kinds[-1] == "message_output_item"
    assert isinstance(result.final_output, str)
    assert len(result.raw_responses) >= 2  # the model was asked at least twice
