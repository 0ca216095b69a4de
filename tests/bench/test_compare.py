"""`bench compare` bookkeeping: configurations from flags and presets, the table, the ratios."""

from __future__ import annotations

import argparse

import pytest

from tokenmill.bench.compare import (
    ConfigOutcome,
    add_compare_args,
    configs_from_args,
    format_ratios,
    format_table,
)
from tokenmill.bench.metrics import RequestRecord, compute_metrics
from tokenmill.bench.presets import PRESETS, Headline, ServerConfig
from tokenmill.bench.report import ServeResult


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_compare_args(parser)
    return parser.parse_args(argv)


def test_presets_and_flags_make_the_configurations() -> None:
    args = parse("--config", "small=--max-num-seqs 4", "--url", "vllm=http://127.0.0.1:8001")
    configs = configs_from_args(args, PRESETS["continuous-vs-static"])
    assert [c.name for c in configs] == ["continuous", "static", "small", "vllm"]
    assert configs[1].server_args == ("--scheduling-policy", "static")
    assert configs[2].server_args == ("--max-num-seqs", "4")
    assert configs[3].url == "http://127.0.0.1:8001"
    with pytest.raises(ValueError, match="nothing to compare"):
        configs_from_args(parse(), None)
    with pytest.raises(ValueError, match="differ"):
        configs_from_args(
            parse("--config", "static=--max-num-seqs 2"), PRESETS["continuous-vs-static"]
        )
    with pytest.raises(ValueError, match="NAME=VALUE"):
        configs_from_args(parse("--config", "no-equals-sign"), None)


def test_dataset_flags_left_unset_fall_back_to_the_preset() -> None:
    args = parse("--preset", "prefix-caching", "--num-prompts", "5")
    assert args.num_prompts == 5 and args.prefix_len is None and args.dataset_name is None


def run(ttft: float) -> ServeResult:
    records = [RequestRecord(0, 10, 3, success=True, output_tokens=3, ttft=ttft, itl=[0.01] * 2,
                             latency=ttft + 0.02)]  # fmt: skip
    return ServeResult(compute_metrics(records, 1.0), records)


def outcome(name: str, *ttfts: float) -> ConfigOutcome:
    if not ttfts:
        return ConfigOutcome(ServerConfig(name), unavailable="error: unrecognized arguments")
    return ConfigOutcome(
        ServerConfig(name),
        [run(t) for t in ttfts],
        run_headlines=[{"mean TTFT (ms)": t * 1000} for t in ttfts],
    )


def test_table_shows_unavailable_configs_and_ratios_use_the_first_measured() -> None:
    headlines = (Headline("mean TTFT (ms)", "mean_ttft_ms"),)
    outcomes = [outcome("on", 0.1), outcome("broken"), outcome("off", 0.4)]
    table = format_table(outcomes, headlines, markdown=True)
    assert "| broken | unavailable: error: unrecognized arguments |" in table
    assert "| on | 1 | 3 | - | 100 | 100 | 10.0 |" in table
    assert format_ratios(outcomes, headlines) == "off / on: mean TTFT (ms) 4.00x"


def test_repeated_runs_report_the_median_of_each_figure() -> None:
    repeated = outcome("on", 0.3, 0.1, 0.2)
    assert repeated.headlines == {"mean TTFT (ms)": pytest.approx(200.0)}
    assert repeated.summary["mean_ttft_ms"] == pytest.approx(200.0)
    assert repeated.summary["completed"] == 1
