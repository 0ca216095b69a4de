"""The README's first command: `tokenmill serve` with no model serves the demo target, whose
sampling defaults (generation_config.json) make a plain request answer a checkable task."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_clients import openai_client
from server_utils import Server, start_server, stop_server

from tokenmill.demo import DEMO_TARGET_NAME


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(None, tmp_path_factory.mktemp("default") / "server.log")
    yield server
    stop_server(server)


def test_newcomer_gets_right_answers_from_the_default_model(default_server: Server) -> None:
    client = openai_client(default_server)
    assert [m.id for m in client.models.list().data] == [DEMO_TARGET_NAME]
    questions = {
        "Reverse this list: apple banana cherry dog": "dog cherry banana apple",
        "Reverse this list: red moon cup": "cup moon red",
        "Sort these numbers: 42 7 19 3 88": "3 7 19 42 88",
        "What is 23 + 58?": "81",
        "What is 40 + 12?": "52",
    }
    right = 0
    for question, answer in questions.items():
        reply = client.chat.completions.create(
            model=DEMO_TARGET_NAME, messages=[{"role": "user", "content": question}], seed=0
        )
        right += reply.choices[0].message.content.strip() == answer
        assert reply.choices[0].finish_reason == "stop"
    assert right >= 4, f"{right}/{len(questions)} right"


def test_start_up_log_names_the_model_and_its_sampling_defaults(default_server: Server) -> None:
    log = default_server.log
    assert f"using the built-in demo model {DEMO_TARGET_NAME}" in log
    assert "default sampling parameters from generation_config.json: {'temperature'" in log
