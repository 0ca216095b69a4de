"""`tokenmill bench throughput` end to end on a tiny model: results, and progress while it runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.entrypoints.cli import main


def test_bench_throughput_shows_progress_and_reports_both_engines(
    tiny_checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result_path = tmp_path / "result.json"
    argv = ["bench", "throughput", "--model", str(tiny_checkpoint("llama")), "--dtype", "float32"]
    argv += ["--max-model-len", "64", "--num-prompts", "4", "--input-len", "4", "8"]
    argv += ["--output-len", "2", "3", "--batch-size", "2", "--repeats", "1"]
    assert main([*argv, "--save-result", str(result_path)]) == 0
    captured = capsys.readouterr()
    assert "Processed prompts" in captured.err and "4/4" in captured.err
    assert "HF static batches" in captured.err and "2/2" in captured.err
    names = [r["name"] for r in json.loads(result_path.read_text())]
    assert names == ["tokenmill", "hf-static-b2"]
    assert main([*argv, "--skip-hf", "--disable-tqdm"]) == 0
    assert "Processed prompts" not in capsys.readouterr().err
