"""`tokenmill bench throughput` end to end on a tiny model: results, and progress while it runs."""

from __future__ import annotations

import json
import re
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


def test_compare_runs_one_engine_per_set_of_flags_and_reports_the_ratio(
    tiny_checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result_path = tmp_path / "result.json"
    argv = ["bench", "throughput", "--model", str(tiny_checkpoint("llama")), "--dtype", "float32"]
    argv += ["--max-model-len", "64", "--num-prompts", "4", "--input-len", "4", "8"]
    argv += ["--output-len", "2", "3", "--batch-size", "2", "--repeats", "2"]
    argv += ["--compare", "auto=", "torch=--linear-backend torch", "fp8=--kv-cache-dtype fp8"]
    assert main([*argv, "--save-result", str(result_path)]) == 0
    out = capsys.readouterr().out
    assert [r["name"] for r in json.loads(result_path.read_text())] == ["auto", "torch", "fp8"]
    assert "HF static batches" not in out
    assert re.search(r"torch / auto: \d+\.\d\dx output throughput, the same tokens", out)
    assert re.search(r"fp8 / auto: \d+\.\d\dx output throughput, (the same|different) tokens", out)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("novalue", 'expected NAME="ENGINE FLAGS"'),
        ("a=--no-such-flag 1", "--compare a: not an engine flag: --no-such-flag 1"),
        ("a=--max-model-len many", "--compare a: argument --max-model-len"),
    ],
)
def test_a_bad_compare_entry_is_a_clear_error(
    tiny_checkpoint, entry: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "throughput", "--model", str(tiny_checkpoint("llama")), "--compare", entry]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
