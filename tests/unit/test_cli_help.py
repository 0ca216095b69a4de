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
    scheduler = " ".join(help_text(["serve", "--help=scheduler"], capsys).split())
    assert "the token budget of one step (default: 2048)" in scheduler
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
    text = " ".join(help_text(["serve", "--help=model"], capsys).split())
    assert "GGUF file" in text.split("--model MODEL")[-1][:200]


ENGINE_COMMANDS = (["serve"], ["generate"], ["bench", "throughput"], ["eval"])


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_help_lists_engine_flags_by_name_only(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """`eval --help` was 185 lines: the engine's 30-odd flags are named, not explained."""
    short = help_text([*command, "--help"], capsys)
    everything = help_text([*command, "--help=all"], capsys)
    assert len(short.splitlines()) < len(everything.splitlines()) - 80
    for flag in ("--max-num-seqs", "--kv-cache-dtype", "--speculative-config", "--model"):
        assert flag in short and flag in everything
    assert "the token budget of one step" not in short
    assert "the token budget of one step" in everything


def test_eval_help_fits_a_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert len(help_text(["eval", "--help"], capsys).splitlines()) <= 60


def test_help_explains_one_section_or_the_flags_mentioning_a_word(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cache = " ".join(help_text(["eval", "--help=cache"], capsys).split())
    assert "--kv-cache-dtype" in cache and "--max-num-seqs" not in cache
    assert "--tasks" not in cache  # eval's own flags are in the plain --help
    prefix = " ".join(help_text(["serve", "--help=prefix"], capsys).split())
    assert "--enable-prefix-caching" in prefix and "--prefix-chars" in prefix
    assert "--max-num-seqs" not in prefix
    nothing = help_text(["serve", "--help=no-such-word"], capsys)
    assert "no flag mentions 'no-such-word'" in nothing
