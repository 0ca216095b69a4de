"""The README's tool loop, as examples/tool_calling/ runs it with the `openai` and the
`anthropic` SDK against `tokenmill serve` and the demo model (greedy): the model calls
`multiply` with the question's numbers, the script runs it, and the answer states the result.
The README shows each script's code as it is."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_utils import Server, start_server, stop_server

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples" / "tool_calling"
# What each script prints: the call it ran, then the model's answer.
TRANSCRIPT = "multiply({'a': 1234, 'b': 56}) -> 69104\n1234 times 56 is 69104.\n"


@pytest.fixture(scope="module")
def example_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Started as the README starts it (a longer context: the tools fill ~250 tokens)."""
    log_path = tmp_path_factory.mktemp("tool-examples") / "server.log"
    args = ("--served-model-name", "my-model", "--api-key", "sk-local", "--max-model-len", "1024")
    args += ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    server = start_server(None, log_path, *args)
    yield server
    stop_server(server)


@pytest.mark.parametrize("script", ["openai_sdk.py", "anthropic_sdk.py"])
def test_the_example_runs_the_whole_tool_loop(example_server: Server, script: str) -> None:
    pytest.importorskip(script.removesuffix("_sdk.py"))
    env = {**os.environ, "TOKENMILL_URL": example_server.url}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == TRANSCRIPT


@pytest.mark.parametrize("script", ["openai_sdk.py", "anthropic_sdk.py"])
def test_the_readme_shows_the_examples_code(script: str) -> None:
    code = (EXAMPLES / script).read_text()
    body = code[code.index('"""', 3) + 3 :].strip()  # the code after the docstring
    readme = (ROOT / "README.md").read_text()
    assert f"```python\n{body}\n```" in readme
