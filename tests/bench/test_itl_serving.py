"""The served ITL-under-prefill benchmark (tokenmill/bench/itl_serving.py, stats.py,
llamacpp.py): its statistics from chunk arrival times, its request bodies and server command
lines, its table row, and one small run against a real `tokenmill serve` (no timed assertion)."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from tokenmill.bench.itl_serving import (
    Scenario,
    chunk_times,
    completion_request,
    endpoint,
    llama_server,
    run_control,
    run_scenario,
    scenario_run,
    tokenmill_server,
)
from tokenmill.bench.itl_stats import ControlSteps, Run, disaggregation_check, percentile, report
from tokenmill.bench.llamacpp import source_tree, whole_character_bias
from tokenmill.bench.metrics import RequestRecord
from tokenmill.models.loader import load_tokenizer


def test_chunk_times_rebuild_each_arrival_from_the_first_token_and_the_gaps() -> None:
    record = RequestRecord(0, prompt_len=4, expected_output_len=8)
    assert chunk_times(record) == []  # nothing streamed yet
    record.start_time, record.ttft, record.itl = 1.0, 0.5, [0.25, 0.5]
    assert chunk_times(record) == [1.5, 1.75, 2.25]


def steady_then_stall(start: float, gap: float, arrival: float, stall: float) -> list[float]:
    """A stream's chunk times: `gap` apart until past `arrival`, then one `stall`, then `gap`
    apart again."""
    times = [start]
    while times[-1] <= arrival:
        times.append(times[-1] + gap)
    times.append(times[-1] + stall)
    times += [times[-1] + gap * i for i in (1, 2)]
    return times


def test_scenario_run_splits_steady_gaps_from_the_window_of_the_long_prompt() -> None:
    # Two streams at 0.1 s per token; the long prompt arrives at 1.05 s; its first token comes
    # with the stall step, so each stream's window is: the gap spanning the arrival, the stall.
    # Stream 0's chunk of that step arrives 5 ms before the long prompt's token, stream 1's
    # 15 ms after: both end their window there, not one step later.
    streams = [steady_then_stall(0.0, 0.1, 1.05, 2.0), steady_then_stall(0.02, 0.1, 1.05, 2.0)]
    first_token = streams[0][-3] + 0.005
    run = scenario_run(streams, all_streaming=0.02, arrival=1.05, first_token=first_token,
                       long_prompt=100, steps_over_target=3)  # fmt: skip
    assert run.steady == pytest.approx(0.1)
    assert sorted(run.admission_itls) == pytest.approx([0.1, 0.1, 2.0, 2.0])
    assert run.p99 == pytest.approx(2.0)
    assert run.num_steps == 2
    assert run.ttft == pytest.approx(first_token - 1.05)
    assert run.throughput == pytest.approx((100 + 1 + 4) / run.ttft)
    assert run.steps_over_target == 3
    assert run.window == (10, 11)  # the streams' gaps 10 and 11: their control's positions
    assert sorted(run.admission_positions) == [10, 10, 11, 11]  # each gap's own position


def test_scenario_run_refuses_a_stream_cut_before_the_long_prompts_first_token() -> None:
    streams = [[0.0, 0.1, 0.2, 0.3]]
    with pytest.raises(ValueError, match="at or after the long prompt's first token"):
        scenario_run(streams, all_streaming=0.0, arrival=0.15, first_token=0.5, long_prompt=10)
    with pytest.raises(ValueError, match="no steady"):
        scenario_run(streams, all_streaming=0.0, arrival=0.05, first_token=0.3, long_prompt=10)


def test_the_request_body_is_a_streamed_greedy_token_id_completion() -> None:
    body = endpoint("http://127.0.0.1:9/", "m").payload(completion_request([5, 6, 7], 9), 9)
    assert body == {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 9,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def test_extra_fields_reach_the_body() -> None:
    bias = {"logit_bias": {"7": -100}}
    body = endpoint("http://127.0.0.1:9", "m", bias).payload(completion_request([5], 2), 2)
    assert body["logit_bias"] == {"7": -100} and body["prompt"] == [5]


def test_text_from_tokens_the_llama_bias_allows_never_ends_mid_character(
    tiny_checkpoint,
) -> None:
    checkpoint = tiny_checkpoint("llama")
    bias = whole_character_bias(checkpoint)
    assert bias and set(bias.values()) == {-100}  # byte-level BPE: lone bytes >= 0x80 exist
    tokenizer = load_tokenizer(checkpoint)
    allowed = [i for i in range(len(tokenizer)) if str(i) not in bias]
    rng = random.Random(0)
    for _ in range(50):
        text = tokenizer.decode(rng.choices(allowed, k=40))
        assert "\ufffd" not in text


def test_the_servers_get_the_scenarios_slots_and_context(tmp_path: Path) -> None:
    scenario = Scenario(streams=4, stream_prompt=8, stream_max_tokens=100, long_prompt=300)
    llama = llama_server(tmp_path, Path("m.gguf"), scenario, 3, ["-ub", "64"], tmp_path / "l")
    command = llama.command
    assert command[0] == str(tmp_path / "llama-server")

    def value(flag: str) -> str:
        return command[command.index(flag) + 1]

    assert value("-m") == "m.gguf" and value("-t") == "3" and value("--parallel") == "5"
    assert value("-c") == str(5 * (300 + 1 + 16))  # each slot holds the longest request
    assert "--kv-unified" not in command and command[-2:] == ["-ub", "64"]
    served = tokenmill_server(Path("/m"), 8192, ["--itl-target-ms", "50.0"], tmp_path / "t")
    assert served.server_args == ["--model", "/m", "--dtype", "float32", "--max-model-len",
                                  "8192", "--itl-target-ms", "50.0"]  # fmt: skip


def test_source_tree_is_found_above_a_build_directory(tmp_path: Path) -> None:
    (tmp_path / "convert_hf_to_gguf.py").touch()
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    assert source_tree(bin_dir) == tmp_path.resolve()
    with pytest.raises(FileNotFoundError):
        source_tree(Path("/"))


def test_report_formats_the_row_from_the_medians_of_repeats() -> None:
    def run(steady: float, worst: float) -> Run:
        return Run(steady, [steady, worst], ttft=2.0, throughput=1234.0, steps_over_target=None,
                   num_steps=2)  # fmt: skip

    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    row = report("cfg", [run(0.1, 1.5), run(0.3, 2.5), run(0.2, 2.0)])
    assert row == "| cfg | 200 ms | 2,000 ms | 2,000 ms | 10.0x | 2.0 s | 2 | 1,234 tok/s | - |"


def test_a_small_run_against_tokenmill_serve_reports_a_complete_row(
    tmp_path: Path, tiny_checkpoint
) -> None:
    checkpoint = tiny_checkpoint("llama")
    vocab_size = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    # Streams long enough to outlast the run on a loaded machine (they are cancelled after it):
    # with 200 tokens, a stream once finished before the long prompt's first token.
    scenario = Scenario(streams=3, stream_prompt=8, stream_max_tokens=1500, long_prompt=120,
                        steady_steps=2, vocab_size=vocab_size)  # fmt: skip
    flags = ["--itl-target-ms", "1000", "--disable-log-stats"]
    server = tokenmill_server(checkpoint, 2048, flags, tmp_path / "s.log")
    with server:
        run = asyncio.run(run_scenario(server.base_url, scenario))
        assert run.window is not None and run.window[0] <= run.window[1]
        control, control_p99, steps = asyncio.run(
            run_control(server.base_url, scenario, run.window)
        )
    assert 0 < control <= control_p99  # the control streams' gaps at the window's positions
    assert set(range(*run.window)) <= set(steps.by_position)
    assert all(step > 0 for step in steps.by_position.values()) and steps.relative_p99 >= 1
    assert run.relative_p99 is None  # until the control's steps are in
    assert run.ttft > 0 and run.steady > 0 and run.throughput > 0
    assert run.num_steps >= 1
    assert len(run.admission_itls) >= scenario.streams  # each stream, at least its last gap
    assert run.steps_over_target is not None and run.steps_over_target >= 0


def test_the_control_step_at_a_position_is_the_median_of_its_neighbours() -> None:
    # Positions 0..19 at 100 ms, one slow step at 10: it does not raise its own reference.
    gaps = {p: [0.1, 0.1] for p in range(20)}
    gaps[10] = [0.3, 0.3]
    steps = ControlSteps.from_gaps(gaps)
    assert steps.at(10) == pytest.approx(0.1)
    assert steps.at(25) == steps.at(19)  # past the control's positions: the nearest one's
    assert steps.relative_p99 == pytest.approx(3.0)  # the control's own tail, over it
    # A growing step: each position's reference follows it.
    growing = ControlSteps.from_gaps({p: [0.1 + 0.01 * p] for p in range(30)})
    assert growing.at(15) == pytest.approx(0.25)


def test_each_gap_is_judged_against_the_control_step_at_its_own_position() -> None:
    steps = ControlSteps.from_gaps({p: [0.1 + 0.01 * p] * 4 for p in range(40)})
    # Gaps 20 % over their own position's step: 1.2x, however much the step grew meanwhile.
    positions = list(range(10, 30)) * 5
    itls = [1.2 * (0.1 + 0.01 * p) for p in positions]
    run = Run(0.2, itls, ttft=1.0, throughput=1.0, steps_over_target=None, num_steps=20,
              admission_positions=positions, control_steps=steps)  # fmt: skip
    assert run.relative_p99 == pytest.approx(1.2)
    assert run.p99 / steps.at(20) > 1.4  # over one median for the window, the growth counts


def test_the_disaggregation_goal_is_judged_against_the_control_at_the_same_tokens() -> None:
    """p99 of each gap over the control run's step at its token position (the streams' own
    step at that context); the control's median over the window and the gap before the
    arrival are reported beside it."""
    chunked = [Run(0.1, [0.1] * 99 + [0.2], ttft=30.0, throughput=100.0, steps_over_target=None,
                   num_steps=5)]  # fmt: skip
    steps = ControlSteps.from_gaps({p: [0.12] * 4 for p in range(100)})
    pair = [Run(0.1, [0.13] * 100, ttft=27.0, throughput=105.0, steps_over_target=None,
                num_steps=5, control_steady=0.12, control_p99=0.132,
                admission_positions=list(range(100)), control_steps=steps)]  # fmt: skip
    text = disaggregation_check("pair", chunked, pair)
    assert "p99 of each gap over its own steady step (the control's at its token position) " in text
    assert "1.08x (ok; the control's own 1.00x)" in text
    assert "p99 over the control's median in the window 1.08x (the control run's 120 ms, " in text
    assert "its own p99 1.10x that)" in text
    assert "p99/steady before arrival 1.30x" in text
    assert "TTFT 0.90x the chunked engine's (ok)" in text
    slow = [replace(pair[0], admission_itls=[0.15] * 100)]
    assert "1.25x (over 1.2x" in disaggregation_check("pair", chunked, slow)


def test_targets_follow_the_calibration_run_with_the_lowest_steady_step() -> None:
    from tokenmill.bench.itl import measure

    steadies = iter([0.088, 0.073, 0.075])  # the first calibration run was slowed by noise

    def baseline() -> Run:
        return Run(next(steadies), [0.1], ttft=1.0, throughput=1.0, steps_over_target=None,
                   num_steps=1)  # fmt: skip

    targets: list[float] = []

    def rest(calibrated: Run):
        targets.append(calibrated.steady)
        return {"target": lambda: replace(calibrated, target=2 * calibrated.steady)}

    runs = measure("baseline", baseline, rest, repeats=3, calibration_runs=2)
    assert targets == [0.073]
    assert [r.steady for r in runs["baseline"]] == [0.088, 0.073, 0.075]  # 2 + the third repeat
    assert [r.target for r in runs["target"]] == [0.146] * 3


def test_bench_itl_runs_the_offline_scenario_from_the_cli(tiny_checkpoint, capsys) -> None:
    from tokenmill.entrypoints.cli import main

    code = main(
        ["bench", "itl", "--model", str(tiny_checkpoint("llama")), "--streams", "2",
         "--stream-prompt", "8", "--long-prompt", "96", "--steady-steps", "2", "--only-targets",
         "--max-model-len", "256"]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "| 2048 chunked |" in out and "| itl target 2.0x its steady step |" in out
    assert "Issue 19's goal, against 2048 chunked:" in out
