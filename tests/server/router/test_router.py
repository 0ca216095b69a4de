"""What the router adds: aggregated metrics, prefix affinity through real replicas, the
`tokenmill router` command in front of separately started servers, and a replica that dies
mid-request."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest
from router_utils import (
    HEALTHY,
    NUM_REPLICAS,
    PREFIX_CHARS,
    replica_urls,
    routed_counts,
    start_router,
)
from server_utils import API_KEY, MODEL, scrape, start_server, stop_server
from test_prometheus_metrics import COUNTERS, GAUGES

from tokenmill.entrypoints.router.policies import POLICIES

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def test_metrics_show_every_replica_under_a_replica_label(http: httpx.Client) -> None:
    metrics = scrape(http)
    urls = replica_urls(http)
    assert len(urls) == NUM_REPLICAS
    for url in urls:
        assert metrics[f'{HEALTHY}{{replica="{url}"}}'] == 1
        for name in COUNTERS + GAUGES:
            labels = name.partition("{")[2].rstrip("}")
            base = name.partition("{")[0]
            key = f"tokenmill:{base}" + "".join(
                f"{{{part}}}" for part in sorted([*filter(None, [labels]), f'replica="{url}"'])
            )
            assert key in metrics, key


def test_prefix_aware_keeps_a_shared_prefix_on_one_replica(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    system = ("Tenant seven's rules. " * 8)[:PREFIX_CHARS]
    before = routed_counts(http)
    for question in ("What?", "Why not?", "When, then?", "Who is it?"):
        client.completions.create(model=MODEL, prompt=system + question, max_tokens=2)
    after = routed_counts(http)
    moved = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    assert len(moved) == 1, moved
    (((_, decision), count),) = moved.items()
    assert (decision, count) == ("prefix_affinity", 4)


def test_router_command_round_robins_over_separately_started_servers(
    http: httpx.Client, tmp_path: Path
) -> None:
    urls = replica_urls(http)
    router = start_router(urls, tmp_path / "router.log", "--policy", "round-robin")
    try:
        with httpx.Client(base_url=router.url, headers=HEADERS, timeout=60) as routed:
            for _ in range(2 * len(urls)):
                body = {"model": MODEL, "prompt": "Same prompt", "max_tokens": 1}
                assert routed.post("/v1/completions", json=body).status_code == 200
            counts = routed_counts(routed)
        assert counts == {(url, "round_robin"): 2.0 for url in urls}
    finally:
        stop_server(router)


def test_a_replica_killed_mid_stream_is_taken_out_and_its_stream_ends_in_an_error(
    model_dir: Path, http: httpx.Client, tmp_path: Path
) -> None:
    doomed = start_server(model_dir, tmp_path / "doomed.log", timeout=300)
    survivor = replica_urls(http)[0]
    router = start_router(
        [doomed.url, survivor], tmp_path / "router.log", "--policy", "round-robin"
    )
    try:
        events: list[str] = []
        first = threading.Event()
        body = {
            "model": MODEL, "prompt": "Long", "max_tokens": 200, "ignore_eos": True,
            "stream": True,
        }  # fmt: skip

        def stream() -> None:
            url = f"{router.url}/v1/completions"
            with httpx.stream("POST", url, json=body, headers=HEADERS, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()  # round-robin: the first request goes to the first backend, `doomed`
        assert first.wait(60)
        doomed.process.send_signal(signal.SIGKILL)
        reader.join(60)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "replica_failed" and doomed.url in error["message"]

        with httpx.Client(base_url=router.url, headers=HEADERS, timeout=60) as routed:
            for _ in range(3):  # all to the survivor now
                short = {"model": MODEL, "prompt": "Still there?", "max_tokens": 2}
                assert routed.post("/v1/completions", json=short).status_code == 200
            metrics = scrape(routed)
        assert metrics[f'{HEALTHY}{{replica="{doomed.url}"}}'] == 0
        assert metrics[f'{HEALTHY}{{replica="{survivor}"}}'] == 1
    finally:
        stop_server(router)
        stop_server(doomed)


EXPECTED_DECISIONS = {
    "round-robin": {"round_robin"},
    "least-loaded": {"least_loaded"},
    "prefix-aware": {"prefix_affinity", "prefix_spill"},
}


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_serves_the_openai_api(
    policy: str, http: httpx.Client, tmp_path: Path
) -> None:
    """A router of each policy in front of the replicas answers completions, streamed chat and
    an error as a server does, and routes by its own rule."""
    router = start_router(replica_urls(http), tmp_path / "router.log", "--policy", policy)
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=API_KEY, max_retries=0)
        completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        assert completion.usage.completion_tokens == 3
        messages = [{"role": "user", "content": "Hi"}]
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="Hello", max_tokens=1)
        with httpx.Client(base_url=router.url, headers=HEADERS, timeout=60) as routed:
            decisions = {decision for _, decision in routed_counts(routed)}
        assert decisions and decisions <= EXPECTED_DECISIONS[policy], decisions
    finally:
        stop_server(router)
