"""`tokenmill bench serve | sweep | compare` against real `tokenmill serve` processes (tiny
random model, few prompts), and the static policy observed in the engine's step records."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenmill.bench.server_process import ServerProcess
from tokenmill.entrypoints.cli import main

SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--disable-log-stats"]
PNG_MAGIC = b"\x89PNG"


def start_server(
    tmp_path_factory: pytest.TempPathFactory, checkpoint: Path, *extra: str
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess(["--model", str(checkpoint), *SERVER_ARGS, *extra], log, 180) as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_checkpoint) -> Iterator[ServerProcess]:
    yield from start_server(tmp_path_factory, tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def static_server(tmp_path_factory, tiny_checkpoint) -> Iterator[ServerProcess]:
    yield from start_server(
        tmp_path_factory, tiny_checkpoint("llama"), "--scheduling-policy", "static",
        "--max-num-seqs", "3",
    )  # fmt: skip


def bench(*args: str) -> None:
    assert main(["bench", *args, "--disable-tqdm"]) == 0


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:4] == PNG_MAGIC, f"{path} is not a PNG"


@pytest.mark.parametrize(
    ("endpoint", "dataset"),
    [
        ("/v1/completions", "random"),
        ("/v1/chat/completions", "random"),
        ("/v1/completions", "random-ids"),
    ],
)
def test_bench_serve_writes_a_complete_result_and_plots(
    server: ServerProcess, tmp_path: Path, endpoint: str, dataset: str
) -> None:
    out = tmp_path / "result.json"
    bench("serve", "--base-url", server.base_url, "--endpoint", endpoint, "--num-prompts", "6",
          "--dataset-name", dataset,
          "--random-input-len", "24", "--random-output-len", "8", "--request-rate", "50",
          "--goodput", "ttft:60000", "tpot:60000", "--save-result", str(out),
          "--plot", str(tmp_path / "plots"))  # fmt: skip
    result = load(out)
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["total_output_tokens"] == 6 * 8  # ignore_eos: the dataset's lengths
    for key in ("mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p95_itl_ms", "p50_e2el_ms"):
        assert result[key] > 0, key
    requests = result["requests"]
    assert len(requests) == 6
    for r in requests:
        assert r["success"] and r["output_tokens"] == 8 and len(r["itl"]) == 7
        assert 0 < r["ttft"] < r["latency"]
        if endpoint == "/v1/completions":  # the dataset's count is the server's count
            assert r["prompt_len"] == 24
    assert_png(tmp_path / "plots" / "timeline.png")
    assert_png(tmp_path / "plots" / "latency_cdf.png")


def test_bench_sweep_reports_each_load_the_knee_and_plots(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep.json"
    bench("sweep", "--base-url", server.base_url, "--max-concurrency-list", "1,4",
          "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "6",
          "--goodput", "ttft:60000", "tpot:60000", "--save-result", str(out),
          "--plot", str(tmp_path / "plots"))  # fmt: skip
    sweep = load(out)
    assert sweep["loads"] == [1.0, 4.0]
    assert sweep["knee"] == 4.0  # generous SLOs: every load meets them
    assert [p["completed"] for p in sweep["points"]] == [4, 4]
    assert all(p["max_concurrent_requests"] <= p["load"] for p in sweep["points"])
    assert len(sweep["results"]) == 2 and len(sweep["results"][1]["requests"]) == 4
    assert "knee: max concurrency = 4" in capsys.readouterr().out
    for name in ("throughput_vs_load", "latency_vs_load", "timeline"):
        assert_png(tmp_path / "plots" / f"{name}.png")


def step_records(server: ServerProcess) -> list[list[float]]:
    """Every step the server ran, as the engine recorded it (the dashboard feed's first update
    carries the window's history): [time, seconds, prefill, decode, num_reqs, k, preempted]."""
    with httpx.stream("GET", f"{server.base_url}/dashboard/events", timeout=60) as events:
        lines = events.iter_lines()
        for line in lines:
            if line == "event: update":
                return json.loads(next(lines).removeprefix("data: "))["steps"]
    raise AssertionError("the feed sent no update")


def joins_into_running_batches(steps: list[list[float]]) -> int:
    """Steps that prefilled a request while others decoded: a request joined a running
    batch. The engine's own count, not the client's clock."""
    return sum(1 for step in steps if step[2] > 0 and step[3] > 0)


def run_staggered(server: ServerProcess, out: Path) -> list[dict[str, Any]]:
    bench("serve", "--base-url", server.base_url, "--num-prompts", "9",
          "--random-input-len", "16", "--random-output-len", "48", "--request-rate", "40",
          "--seed", "1", "--save-result", str(out))  # fmt: skip
    requests = load(out)["requests"]
    assert all(r["success"] for r in requests)
    return requests


def test_static_server_lets_no_request_join_a_running_batch(
    static_server: ServerProcess, server: ServerProcess, tmp_path: Path
) -> None:
    run_staggered(static_server, tmp_path / "static.json")
    static = step_records(static_server)
    assert joins_into_running_batches(static) == 0
    assert sum(1 for step in static if step[2] > 0) >= 3  # 9 requests, 3 at a time: batches
    # The same arrivals on a continuous-batching server: requests do join running batches, so
    # the count above can see a join when there is one.
    run_staggered(server, tmp_path / "fcfs.json")
    assert joins_into_running_batches(step_records(server)) > 0


def test_bench_compare_repeats_each_config_and_reports_a_refused_one_as_unavailable(
    server: ServerProcess, tiny_checkpoint, tmp_path: Path
) -> None:
    out_dir = tmp_path / "compare"
    bench("compare", "--url", f"running={server.base_url}",
          "--config", "refused=--no-such-flag", "--model", str(tiny_checkpoint("llama")),
          "--dataset-name", "random", "--num-prompts", "3", "--random-input-len", "16",
          "--random-output-len", "4", "--server-start-timeout", "60", "--repeats", "2",
          "--output-dir", str(out_dir))  # fmt: skip
    configs = {c["name"]: c for c in load(out_dir / "compare.json")["configs"]}
    assert [run["completed"] for run in configs["running"]["runs"]] == [3, 3]
    assert configs["running"]["summary"]["completed"] == 3
    assert configs["running"]["unavailable"] is None
    assert "unrecognized arguments: --no-such-flag" in configs["refused"]["unavailable"]
    assert configs["refused"]["runs"] == []
    assert_png(out_dir / "compare.png")
    assert "refused | unavailable" in (out_dir / "compare.md").read_text()


def test_token_id_prompts_refuse_the_chat_endpoint(tokenizer_dir: Path, capsys) -> None:
    """Refused before any request (no server is contacted: port 9 has none)."""
    args = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m",
            "--tokenizer", str(tokenizer_dir), "--dataset-name", "random-ids",
            "--endpoint", "/v1/chat/completions", "--disable-tqdm"]  # fmt: skip
    assert main(args) == 2  # bad input
    assert "random-ids sends token ids" in capsys.readouterr().err


def test_plots_without_matplotlib_fail_before_the_run(monkeypatch, capsys) -> None:
    """matplotlib is the optional `bench` extra: asking for plots without it is refused up
    front (no server is contacted: port 9 has none), with the install command."""
    from tokenmill.bench import plots

    monkeypatch.setattr(plots, "matplotlib_available", lambda: False)
    args = ["bench", "serve", "--base-url", "http://127.0.0.1:9", "--plot", "plots"]
    assert main([*args, "--disable-tqdm"]) == 1
    assert 'pip install "tokenmill[bench]"' in capsys.readouterr().err
