"""`/dashboard` on a real server: the key guards it, its assets are tokenmill's own, its event
stream starts empty, agrees with /metrics under load, and ends when the server shuts down.
Also: the Grafana board and the alert rules query only metric names /metrics exports."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from server_clients import openai_client
from server_utils import API_KEY, MODEL, Server, scrape, start_server, stop_server, wait_until_idle

EXAMPLES = Path(__file__).parents[2] / "examples" / "observability"
SPEC_CONFIG = '{"method": "ngram", "num_speculative_tokens": 2, "adaptive": false}'


@pytest.fixture(scope="module")
def dashboard_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """With speculation, so every metric family a board can ask for is exported."""
    log_path = tmp_path_factory.mktemp("dashboard") / "server.log"
    server = start_server(
        model_dir, log_path, "--speculative-config", SPEC_CONFIG, "--slo", "ttft=2s,tpot=500ms"
    )
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def dashboard_http(dashboard_server: Server) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=dashboard_server.url, headers=headers, timeout=60) as http:
        yield http


def read_events(http: httpx.Client, num_updates: int) -> tuple[dict[str, Any], list[dict]]:
    """The `setup` event and the first `num_updates` updates of one dashboard stream."""
    setup: dict[str, Any] = {}
    updates: list[dict[str, Any]] = []
    with http.stream("GET", "/dashboard/events") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                if name == "setup":
                    setup = data
                else:
                    updates.append(data)
                if len(updates) == num_updates:
                    break
    return setup, updates


def drive_load(server: Server, num_requests: int = 6) -> None:
    client = openai_client(server)
    threads = [
        threading.Thread(
            target=client.completions.create,
            kwargs={"model": MODEL, "prompt": f"one two three {i} one two three", "max_tokens": 8},
        )
        for i in range(num_requests)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_an_idle_server_streams_empty_state(dashboard_http: httpx.Client) -> None:
    setup, updates = read_events(dashboard_http, 2)
    assert setup["model"] == MODEL
    assert setup["slo"] == {"ttft": 2.0, "tpot": 0.5}
    assert setup["speculative"] == {"method": "ngram", "max_k": 2}
    first, second = updates
    assert first["steps"] == first["finished"] == first["itl"] == first["ttft"] == []
    assert first["queues"] == {"running": 0, "waiting": 0, "swapped": 0}
    assert first["totals"]["generation_tokens"] == first["totals"]["finished_requests"] == 0
    assert first["kv"]["num_used"] == 0 and set(first["kv"]["block_map"]) == {"0"}
    assert second["now"] > first["now"]  # a later snapshot (the interval is the server's sleep)


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Bearer wrong"}, 401),
        ({"Authorization": f"Bearer {API_KEY}"}, 200),
        ({"Authorization": "Basic " + base64.b64encode(f"x:{API_KEY}".encode()).decode()}, 200),
        ({"Authorization": "Basic not-base64!"}, 401),
    ],
)
def test_the_dashboard_needs_the_api_key(
    dashboard_server: Server, headers: dict[str, str], status: int
) -> None:
    for path in ("/dashboard", "/dashboard/assets/dashboard.js"):
        response = httpx.get(dashboard_server.url + path, headers=headers)
        assert response.status_code == status
        if status == 401:  # a browser asks for the key itself, and API clients get OpenAI's shape
            assert response.headers["www-authenticate"].startswith("Basic")
            assert response.json()["error"]["message"]


def test_every_asset_is_served_by_tokenmill(dashboard_http: httpx.Client) -> None:
    page = dashboard_http.get("/dashboard")
    assert page.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(assets) == [
        "/dashboard/assets/dashboard.css",
        "/dashboard/assets/dashboard.js",
        "data:,",  # no favicon request
    ]
    for path in (asset for asset in assets if asset.startswith("/")):
        body = dashboard_http.get(path)
        assert body.status_code == 200
        assert "http://" not in body.text and "https://" not in body.text  # no CDN
    assert dashboard_http.get("/dashboard/assets/../server.log").status_code == 404


def _chromium() -> str | None:
    """The system Chromium, if there is one and Playwright's Python package to drive it."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return None
    return shutil.which("chromium") or shutil.which("chromium-browser")


CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@pytest.mark.browser
@pytest.mark.skipif(_chromium() is None, reason="needs chromium (apt) and playwright (pip)")
def test_the_dashboard_in_a_real_browser(
    dashboard_server: Server, dashboard_http: httpx.Client, tmp_path: Path
) -> None:
    """Load drives the page's numbers; once idle they equal /metrics. Saves a screenshot (and
    copies it to $TOKENMILL_DASHBOARD_SCREENSHOT when set, to look at)."""
    from playwright.sync_api import sync_playwright

    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            drive_load(dashboard_server, num_requests=4)

    loader = threading.Thread(target=load)
    errors: list[str] = []
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            tmp_path / "profile",  # a fresh --user-data-dir
            executable_path=_chromium(),
            args=CHROMIUM_FLAGS,
            http_credentials={"username": "operator", "password": API_KEY},
            viewport={"width": 1400, "height": 1000},
        )
        try:
            page = context.new_page()
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(f"{dashboard_server.url}/dashboard")
            page.select_option("#window", "300")  # every request of this module so far
            page.wait_for_selector("#connection[data-state=live]", timeout=30_000)
            # No traffic yet (the tests above send none): empty states, not errors.
            page.wait_for_function(
                "document.getElementById('total-finished').dataset.value === '0'", timeout=10_000
            )
            for empty in ("#steps-empty", "#latency-empty"):
                assert page.is_visible(empty), empty
            assert errors == []
            loader.start()
            page.wait_for_selector("#steps-empty[hidden]", state="attached", timeout=30_000)
            page.wait_for_function(
                "Number(document.getElementById('total-finished').dataset.value) >= 8",
                timeout=60_000,
            )
            stop.set()
            loader.join()
            metrics = wait_until_idle(dashboard_http)
            # The page catches up within a few updates.
            expected = {
                "total-generation-tokens": metrics["tokenmill:generation_tokens_total"],
                "total-prompt-tokens": metrics["tokenmill:prompt_tokens_total"],
                "total-finished": metrics["tokenmill:e2e_request_latency_seconds_count"],
                "total-preemptions": sum(
                    v for k, v in metrics.items() if k.startswith("tokenmill:num_preemptions_total")
                ),
                "queue-running": metrics["tokenmill:num_requests_running"],
                "queue-waiting": metrics["tokenmill:num_requests_waiting"],
                "kv-usage": metrics["tokenmill:kv_cache_usage_perc"],
            }
            deadline = (
                time.monotonic() + 60
            )  # a hang guard: the board updates several times a second
            while True:
                shown = page.evaluate(
                    """() => Object.fromEntries([...document.querySelectorAll('[data-value]')]
                        .filter(el => el.id).map(el => [el.id, el.dataset.value]))"""
                )
                if all(float(shown[k]) == v for k, v in expected.items()):
                    break
                assert time.monotonic() < deadline, (expected, shown)
                time.sleep(0.25)
            hits = metrics["tokenmill:prefix_cache_hits_total"]
            queries = metrics["tokenmill:prefix_cache_queries_total"]
            assert float(shown["prefix-hit-rate"]) == pytest.approx(hits / queries)
            ttft_row = page.eval_on_selector_all(
                "#latency-ttft td[data-value]", "cells => cells.map(c => Number(c.dataset.value))"
            )
            assert ttft_row[-1] == metrics["tokenmill:time_to_first_token_seconds_count"]
            assert _within_histogram_median(ttft_row[0], metrics, "time_to_first_token_seconds")
            # The random model's output seldom repeats, so the n-gram proposer may draft nothing.
            drafted = metrics["tokenmill:spec_decode_num_draft_tokens_total"]
            accepted = metrics["tokenmill:spec_decode_num_accepted_tokens_total"]
            if drafted:
                assert float(shown["spec-acceptance-total"]) == pytest.approx(accepted / drafted)
            else:
                assert shown["spec-acceptance-total"] == ""  # shown as "–", not as an error
            assert shown["spec-k"] == "2"  # not adaptive: always the maximum
            assert 0 <= float(shown["within-slo"]) <= 1  # --slo ttft=2s,tpot=500ms
            page.fill("#slo-ttft", "0.0001")  # set on the page: nobody answers in 100 ns
            page.wait_for_function("document.getElementById('within-slo').dataset.value === '0'")
            screenshot = tmp_path / "dashboard.png"
            page.screenshot(path=screenshot, full_page=True)
            assert screenshot.stat().st_size > 10_000
            target = os.environ.get("TOKENMILL_DASHBOARD_SCREENSHOT")
            if target:
                shutil.copy(screenshot, target)
        finally:
            stop.set()
            if loader.is_alive():
                loader.join()
            context.close()
    assert errors == []


def _within_histogram_median(p50: float, metrics: dict[str, float], name: str) -> bool:
    """The page's exact median lies in the histogram bucket that holds /metrics' median."""
    buckets = sorted(
        (float(key.split('le="')[1].rstrip('"}')), count)
        for key, count in metrics.items()
        if key.startswith(f"tokenmill:{name}_bucket")
    )
    total = metrics[f"tokenmill:{name}_count"]
    # The median's sample(s) (the middle one, or the middle two for an even count) lie above
    # the last bound holding fewer than half and at or below the first holding more than half.
    lower = max((le for le, count in buckets if count < total / 2), default=0.0)
    upper = min(le for le, count in buckets if count > total / 2)
    return lower <= p50 <= upper


def test_the_stream_agrees_with_metrics_after_load(
    dashboard_server: Server, dashboard_http: httpx.Client
) -> None:
    drive_load(dashboard_server)
    metrics = wait_until_idle(dashboard_http)
    _, (update,) = read_events(dashboard_http, 1)
    totals = update["totals"]
    assert totals["generation_tokens"] == metrics["tokenmill:generation_tokens_total"] > 0
    assert totals["prompt_tokens"] == metrics["tokenmill:prompt_tokens_total"] > 0
    assert totals["finished_requests"] == metrics["tokenmill:e2e_request_latency_seconds_count"]
    assert totals["first_tokens"] == metrics["tokenmill:time_to_first_token_seconds_count"]
    assert totals["prefix_cache_hits"] == metrics["tokenmill:prefix_cache_hits_total"]
    assert totals["spec_draft_tokens"] == metrics["tokenmill:spec_decode_num_draft_tokens_total"]
    assert (
        totals["spec_accepted_tokens"] == metrics["tokenmill:spec_decode_num_accepted_tokens_total"]
    )
    # The first update of a stream carries the window's history: every step and request.
    assert len(update["finished"]) == totals["finished_requests"]
    assert sum(s[2] for s in update["steps"]) == totals["computed_prompt_tokens"]
    assert len(update["itl"]) == metrics["tokenmill:inter_token_latency_seconds_count"]
    assert update["kv"]["num_used"] == 0 and update["kv"]["num_cached_free"] > 0


def test_grafana_and_alerts_query_only_exported_metrics(dashboard_http: httpx.Client) -> None:
    exported = {key.split("{")[0] for key in scrape(dashboard_http)}
    board = json.loads((EXAMPLES / "grafana-dashboard.json").read_text())
    queries = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    alerts = yaml.safe_load((EXAMPLES / "alerts.yml").read_text())
    queries += [rule["expr"] for group in alerts["groups"] for rule in group["rules"]]
    alert_tests = yaml.safe_load((EXAMPLES / "alerts_test.yml").read_text())
    queries += [s["series"] for test in alert_tests["tests"] for s in test["input_series"]]
    used = {name for query in queries for name in re.findall(r"tokenmill:[\w:]+", query)}
    assert len(used) >= 14
    assert used <= exported, f"not exported: {sorted(used - exported)}"
    panels = {panel["title"] for panel in board["panels"]}
    for title in ("KV Cache Utilization", "Preemptions", "Goodput (upper bound)", "Queue Time"):
        assert title in panels


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian: prometheus)")
def test_alert_rules_pass_promtool_checks_and_fire_on_their_test_series() -> None:
    for check in (
        ["check", "rules", "alerts.yml"],
        ["check", "config", "prometheus.yml"],
        ["test", "rules", "alerts_test.yml"],  # each alert fires on a series that should fire it
    ):
        result = subprocess.run(
            ["promtool", *check], cwd=EXAMPLES, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stdout + result.stderr


# Last: it stops the module's server.
def test_an_open_dashboard_does_not_hold_up_shutdown(dashboard_server: Server) -> None:
    url = f"{dashboard_server.url}/dashboard/events"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("GET", url, headers=headers, timeout=60) as response:
        assert next(response.iter_lines()) == "event: setup"
        # uvicorn re-raises the signal once it has shut down cleanly. (120 s: a hang guard.)
        assert stop_server(dashboard_server, timeout=120) in (0, -signal.SIGTERM)
    # Without the stream ending itself, uvicorn would wait out --shutdown-timeout for it and
    # then cancel it, saying so.
    assert "timeout graceful shutdown exceeded" not in dashboard_server.log, dashboard_server.log
    assert "Application shutdown complete" in dashboard_server.log
