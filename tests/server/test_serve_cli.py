"""`tokenmill serve`'s command line: vLLM's flag names, MODEL or --model."""

from __future__ import annotations

import pytest

from tokenmill.entrypoints.cli import main


def test_serve_help_lists_server_and_engine_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--host", "--port", "--served-model-name", "--api-key", "--shutdown-timeout",
        "--model", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
        "--block-size", "--enable-prefix-caching", "--disable-log-stats",
    ):  # fmt: skip
        assert flag in text, flag


def test_model_argument_and_flag_must_agree(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "/models/a", "--model", "/models/b"]) == 2
    assert "differ" in capsys.readouterr().err
