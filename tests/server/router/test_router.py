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
from server_clients import openai_client
from server_utils import API_KEY, MODEL, scrape, start_server, stop_server
from test_prometheus_metrics import COUNTERS, GAUGES

from tokenmill.entrypoints.http.responses.ids import replica_tag, tag_of
from tokenmill.entrypoints.router.balancing.policies import POLICIES

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
        client = openai_client(router)
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


def test_a_stored_response_is_found_on_the_replica_that_made_it(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    """Each replica has its own response store: `previous_response_id`, GET and DELETE go to
    the replica whose tag the id carries. Two conversations start on the two replicas (no
    prompt key: prefix-aware falls back to round robin) and go on there, in an order round
    robin would get wrong, streamed or not."""
    fields = {"model": MODEL, "max_output_tokens": 2, "temperature": 0}
    before = routed_counts(http)
    chains = [[client.responses.create(input="Hello", **fields).id] for _ in range(2)]
    for turn, chain in enumerate([chains[0], chains[0], chains[1], chains[1], chains[0]]):
        follow_up = {"input": "Go on", "previous_response_id": chain[-1], **fields}
        if turn % 2:  # max_output_tokens: the stream ends with response.incomplete
            events = list(client.responses.create(stream=True, **follow_up))
            assert events[-1].type == "response.incomplete"
            chain.append(events[-1].response.id)
        else:
            chain.append(client.responses.create(**follow_up).id)
    for chain in chains:
        assert client.responses.retrieve(chain[-1]).id == chain[-1]
    assert _decisions_since(before, http) == {"round_robin": 2, "stored_response": 7}
    tags = [{tag_of(response_id) for response_id in chain} for chain in chains]
    assert sorted(tag for (tag,) in tags) == sorted(replica_tag(u) for u in replica_urls(http))
    client.responses.delete(chains[0][0])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(chains[0][0])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="Go on", previous_response_id=chains[0][0], **fields)


def _decisions_since(before: dict, http: httpx.Client) -> dict[str, float]:
    moved: dict[str, float] = {}
    for (replica, decision), count in routed_counts(http).items():
        if count > before.get((replica, decision), 0):
            moved[decision] = moved.get(decision, 0) + count - before.get((replica, decision), 0)
    return moved
