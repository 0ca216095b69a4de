"""README's client examples name the extra that installs their client, and the extra exists."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_the_clients_extra_installs_both_clients() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {re.split(r"[<>=\[ ]", requirement)[0] for requirement in extras["clients"]}
    assert {"openai", "anthropic"} <= names


def test_every_client_example_says_how_to_install_its_client() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"((?:[^\n]*\n){0,3})```python\n(.*?)```", readme, re.DOTALL)
    clients = [
        (before, code)
        for before, code in blocks
        if re.search(r"^from (openai|anthropic) import", code, re.M)
    ]
    assert clients
    for before, code in clients:
        library = re.search(r"^from (openai|anthropic) import", code, re.M).group(1)
        assert ".[clients]" in before and library in before, code[:80]
