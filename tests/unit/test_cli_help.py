"""`tokenmill --help` and friends: every flag explained with its default, every command listed,
a version, and an unknown flag answered with the usage of the command it was given to."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenmill import __version__
from tokenmill.entrypoints.cli import build_parser, main


def commands(
    parser: argparse.ArgumentParser, name: str = "tokenmill"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub_parser in action.choices.items():
                yield from commands(sub_parser, f"{name} {sub_name}")


def help_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_every_flag_of_every_command_has_a_help_text() -> None:
    names = []
    for name, parser in commands(build_parser()):
        names.append(name)
        for action in parser._actions:
            if not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"{name} {action.option_strings or action.dest}"
    assert {"tokenmill serve", "tokenmill generate", "tokenmill bench throughput"} <= set(names)


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    serve = " ".join(help_text(["serve", "--help"], capsys).split())
    assert "port to listen on (default: 8000)" in serve
    assert "the token budget of one step (default: 2048)" in serve
    throughput = " ".join(help_text(["bench", "throughput", "--help"], capsys).split())
    assert "prompt tokens, uniform in [MIN, MAX] (default: [16, 256])" in throughput


def test_a_secret_from_the_environment_stays_out_of_the_help(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENMILL_API_KEY", "sk-very-secret")
    for command in (["serve"], ["bench", "serve"], ["eval"]):
        assert "sk-very-secret" not in help_text([*command, "--help"], capsys), command


def test_the_api_key_help_names_every_route_it_guards(capsys: pytest.CaptureFixture[str]) -> None:
    """It said "/v1 routes"; docs/server.md's flag table lists the keyed routes."""
    docs = (Path(__file__).parents[2] / "docs" / "server.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `--api-key KEY`"))
    keyed = re.findall(r"`(/[^`]*)`", row)
    assert {"/v1/*", "/metrics", "/tokenize"} <= set(keyed)
    serve = help_text(["serve", "--help"], capsys)
    entry = serve.split("\n  --api-key API_KEY", 1)[1].split("\n  --", 1)[0]
    api_key_help = " ".join(entry.split())
    for route in keyed:
        assert route in api_key_help, route


def test_top_level_help_names_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    description = " ".join(help_text(["--help"], capsys).split("options:")[0].split())
    for command in ("serve", "generate", "bench", "eval", "models"):
        assert f" {command}," in description or f" {command};" in description, command


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert help_text(["--version"], capsys).strip() == f"tokenmill {__version__}"


@pytest.mark.parametrize(
    "command", [["serve"], ["generate", "--prompt", "x"], ["bench", "throughput"]]
)
def test_an_unknown_flag_shows_the_usage_of_its_command(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--no-such-flag"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    prog = f"tokenmill {command[0]}" if command[0] != "bench" else "tokenmill bench throughput"
    assert error.startswith(f"usage: {prog} ")
    assert f"{prog}: error: unrecognized arguments: --no-such-flag" in error


def test_help_imports_neither_torch_nor_transformers() -> None:
    """`tokenmill --help` answers at once: building every command's parser must not import the
    seconds-long torch and transformers (a fresh interpreter, so other tests' imports don't
    count)."""
    code = (
        "import sys\n"
        "from tokenmill.entrypoints.cli import build_parser\n"
        "build_parser()\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_tp_worker_help_says_what_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    """Above its flags, not only its usage line."""
    text = " ".join(help_text(["tp-worker", "--help"], capsys).split())
    assert "tensor-parallel ranks" in text.split("options:")[0]


def test_serve_model_help_names_gguf_files(capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(help_text(["serve", "--help"], capsys).split())
    assert "GGUF file" in text.split("--model MODEL")[-1][:200]
