"""Serving metrics on hand-built request timelines: vLLM's definitions, edges included."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokenmill.bench.metrics import (
    RequestRecord,
    compute_metrics,
    meets_slos,
    parse_goodput,
    parse_percentiles,
)
from tokenmill.bench.plots import SweepPoint
from tokenmill.bench.report import format_report, metrics_to_dict
from tokenmill.bench.serve import arrival_offsets
from tokenmill.bench.sweep import find_knee


def record(
    ttft: float,
    itl: list[float],
    output_tokens: int | None = None,
    start: float = 0.0,
    prompt_len: int = 10,
    success: bool = True,
) -> RequestRecord:
    """A request sent at `start` whose chunks arrived `ttft`, then `itl` gaps, later."""
    return RequestRecord(
        index=0,
        prompt_len=prompt_len,
        expected_output_len=output_tokens or len(itl) + 1,
        start_time=start,
        scheduled_time=start,
        success=success,
        output_tokens=output_tokens if output_tokens is not None else len(itl) + 1,
        ttft=ttft,
        itl=list(itl),
        latency=ttft + sum(itl),
    )


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    r = record(0.5, [0.1, 0.2, 0.3])  # 4 tokens, decode took 0.6 s
    assert r.tpot == pytest.approx(0.6 / 3)
    m = compute_metrics([r], duration=1.0)
    assert m.latency["tpot"].mean == pytest.approx(200.0)
    assert m.latency["e2el"].mean == pytest.approx(1100.0)


def test_tpot_counts_tokens_not_chunks() -> None:
    """A server may pack several tokens in a chunk: TPOT divides by tokens (from usage)."""
    r = record(0.5, [0.4], output_tokens=5)  # 2 chunks carrying 5 tokens
    assert r.tpot == pytest.approx(0.4 / 4)


def test_one_token_outputs_have_no_tpot_but_meet_a_tpot_slo() -> None:
    one = record(0.2, [], output_tokens=1)
    assert one.tpot is None
    m = compute_metrics([one], duration=2.0, slos={"tpot": 0.0})
    assert m.latency["tpot"].mean == 0.0  # an empty sample reports 0, as vLLM does
    assert m.request_goodput == pytest.approx(0.5)  # 1 good request / 2 s
    two = record(0.2, [0.05])
    m = compute_metrics([one, two], duration=1.0)
    assert m.latency["tpot"].mean == pytest.approx(50.0)  # only the 2-token request counts


def test_itl_pools_every_gap_of_every_request() -> None:
    a = record(0.1, [0.001, 0.001, 0.001])
    b = record(0.1, [0.010])
    m = compute_metrics([a, b], duration=1.0)
    assert m.latency["itl"].mean == pytest.approx(13.0 / 4)  # not the mean of per-request means
    assert m.latency["itl"].median == pytest.approx(1.0)


def test_goodput_slo_is_inclusive_and_needs_every_slo() -> None:
    r = record(0.5, [0.05, 0.05])  # TTFT 500 ms, TPOT 50 ms, E2EL 600 ms
    assert meets_slos(r, {"ttft": 500.0, "tpot": 50.0, "e2el": 600.0})
    assert not meets_slos(r, {"ttft": 499.999})
    assert not meets_slos(r, {"ttft": 1000.0, "tpot": 49.9})
    assert not meets_slos(r, {"e2el": 599.0})
    failed = record(0.01, [], success=False)
    assert not meets_slos(failed, {"ttft": 1e9})


def test_goodput_counts_good_requests_per_second_of_the_whole_run() -> None:
    good = [record(0.1, [0.01]) for _ in range(3)]
    slow = [record(2.0, [0.01]) for _ in range(2)]
    failed = [record(0.1, [0.01], success=False)]
    m = compute_metrics(good + slow + failed, duration=4.0, slos={"ttft": 1000.0})
    assert m.request_goodput == pytest.approx(3 / 4)
    assert m.request_throughput == pytest.approx(5 / 4)
    assert (m.completed, m.failed) == (5, 1)
    assert compute_metrics(good, duration=4.0).request_goodput is None  # no SLO, no goodput


def test_token_totals_and_throughputs_skip_failed_requests() -> None:
    ok = record(0.1, [0.1] * 9, prompt_len=100)  # 10 output tokens
    failed = record(0.1, [0.1] * 9, prompt_len=1000, success=False)
    m = compute_metrics([ok, failed], duration=2.0)
    assert (m.total_input, m.total_output) == (100, 10)
    assert m.output_throughput == pytest.approx(5.0)
    assert m.total_token_throughput == pytest.approx(55.0)


def test_percentiles_interpolate_like_numpy() -> None:
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    records = [record(v, []) for v in values]
    stats = compute_metrics(records, 1.0, percentiles=(50.0, 95.0, 99.0)).latency["ttft"]
    expected = np.percentile(np.array(values) * 1000, [50, 95, 99])
    assert list(stats.percentiles.values()) == pytest.approx(list(expected))
    assert stats.std == pytest.approx(float(np.std(np.array(values) * 1000)))


def test_empty_run_reports_zeros_not_errors() -> None:
    m = compute_metrics([], duration=0.0, slos={"ttft": 1.0})
    assert m.completed == 0 and m.request_throughput == 0.0 and m.request_goodput == 0.0
    assert all(s.mean == 0.0 for s in m.latency.values())


def test_peaks_of_concurrency_and_chunk_rate() -> None:
    a = record(0.1, [0.1, 0.1], start=0.0)  # in flight 0.0-0.3
    b = record(0.1, [0.1], start=0.2)  # 0.2-0.4
    c = record(0.1, [0.1], start=0.35)  # 0.35-0.55
    m = compute_metrics([a, b, c], duration=1.0)
    assert m.max_concurrent_requests == 2
    assert m.max_output_tokens_per_s == 7.0  # every chunk fell in the first second


def test_a_request_ending_as_another_starts_does_not_overlap() -> None:
    a = record(0.1, [0.1], start=0.0)  # ends at 0.2
    b = record(0.1, [0.1], start=0.2)
    assert compute_metrics([a, b], duration=1.0).max_concurrent_requests == 1


def test_report_and_json_use_vllm_names() -> None:
    m = compute_metrics([record(0.1, [0.02, 0.03])], 1.0, (50.0, 99.9), {"ttft": 200.0})
    text = format_report(m, {"ttft": 200.0})
    for line in ("Successful requests:", "Request goodput (req/s):", "P99.9 TTFT (ms):",
                 "Mean TPOT (ms):", "Median ITL (ms):", "P50 E2EL (ms):"):  # fmt: skip
        assert line in text
    keys = metrics_to_dict(m)
    assert {"mean_ttft_ms", "p99.9_itl_ms", "p50_tpot_ms", "request_goodput"} <= set(keys)


def test_slo_and_percentile_flags_are_checked() -> None:
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:1e4"]) == {
        "ttft": 500.0,
        "tpot": 50.0,
        "e2el": 10000.0,
    }
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert parse_percentiles("50,99.9") == (50.0, 99.9)
    for bad in ("", "101", "p99"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


def test_arrivals_are_reproducible_poisson_and_burstiness_shapes_them() -> None:
    assert arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    poisson = arrival_offsets(20_000, 10.0, 1.0, seed=3)
    assert poisson == arrival_offsets(20_000, 10.0, 1.0, seed=3)
    assert poisson != arrival_offsets(20_000, 10.0, 1.0, seed=4)
    assert poisson[0] == 0.0
    gaps = np.diff(poisson)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.diff(arrival_offsets(20_000, 10.0, 0.25, seed=3))
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)  # same rate ...
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # ... CV 1/sqrt(shape)


def point(load: float, ttft_p95: float, tpot_p95: float) -> SweepPoint:
    return SweepPoint(
        load, 0.0, 0.0, None, {"ttft": {95.0: ttft_p95}, "tpot": {95.0: tpot_p95}, "e2el": {}}
    )


def test_knee_is_the_last_load_before_the_first_slo_miss() -> None:
    slos = {"ttft": 100.0, "tpot": 10.0}
    points = [point(1, 20, 5), point(2, 40, 6), point(4, 100, 10), point(8, 300, 9),
              point(16, 90, 9)]  # fmt: skip
    assert find_knee(points, slos, 95.0) == 4  # SLO met with equality; 16 is noise past the knee
    assert find_knee([point(1, 200, 5)], slos, 95.0) is None
    assert find_knee(points, {}, 95.0) is None
    assert find_knee(points, {"tpot": 5.5}, 95.0) == 1
