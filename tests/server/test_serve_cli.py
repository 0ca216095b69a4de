"""`tokenmill serve`'s command line: vLLM's flag names, MODEL or --model."""

from __future__ import annotations

import socket
import sys

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


def test_a_port_in_use_is_reported_before_the_model_loads(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model directory does not exist: the port, checked first, must be the error."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(tmp_path / "no-model"), "--port", str(port)]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (
        f"tokenmill: error: port {port} on 127.0.0.1 is already in use (another server?); "
        "choose another with --port"
    )


def test_data_parallel_size_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be >= 1" in capsys.readouterr().err


def test_data_parallel_backend_ray_without_ray_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed
    for name in ("ray_replicas", "ray_workers", "ray_cluster"):
        monkeypatch.delitem(sys.modules, f"tokenmill.entrypoints.router.launching.{name}", False)
        monkeypatch.delitem(sys.modules, f"tokenmill.worker.{name}", False)
    argv = ["serve", "--port", "0", "--data-parallel-size", "2", "--data-parallel-backend", "ray"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "--data-parallel-backend ray needs Ray" in error
    assert "pip install 'tokenmill[ray]'" in error
