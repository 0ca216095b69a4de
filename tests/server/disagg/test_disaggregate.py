"""`tokenmill serve --disaggregate` itself: one command starts a prefill and a decode instance
pinned to their own CPUs behind the router, requests really go through both (KV moved, not
recomputed), greedy answers equal a single engine's, and no block stays held."""

from __future__ import annotations

import os
import re

import httpx
import pytest
from server_utils import API_KEY, MODEL, Server, scrape, wait_for
from test_dashboard import read_events

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def instance_urls(server: Server) -> tuple[str, str]:
    """The prefill and decode instances' URLs, from the command's start-up log line."""
    match = re.search(r"prefill instance on (\S+) .* decode instance on (\S+) ", server.log)
    assert match, server.log
    return match[1], match[2]


def instance_pids(server: Server) -> tuple[int, int]:
    match = re.search(
        r"prefill instance on \S+ \(pid (\d+).* decode instance on \S+ \(pid (\d+)", server.log
    )
    assert match, server.log
    return int(match[1]), int(match[2])


def client_for(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def test_each_instance_runs_on_its_own_cpus(server: Server) -> None:
    available = os.sched_getaffinity(0)
    prefill, decode = (os.sched_getaffinity(pid) for pid in instance_pids(server))
    assert prefill | decode <= available
    if len(available) >= 2:
        assert prefill and decode and not prefill & decode
        assert len(prefill) + len(decode) == len(available)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_is_prefilled_on_one_instance_and_decoded_on_the_other(
    server: Server, http: httpx.Client, stream: bool
) -> None:
    prefill_url, decode_url = instance_urls(server)
    before = scrape(http)
    prompt = f"{PROMPT} {'sang' if stream else 'wrote'}"  # nothing of it cached anywhere yet
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    with client_for(decode_url) as decode:
        # The decode instance alone computes the prompt itself (another tenant's salt: its
        # blocks stay out of the request's way; the salt does not change the tokens).
        alone = {**body, "cache_salt": "reference"}
        expected = decode.post("/v1/completions", json=alone).json()["choices"][0]["text"]
    if stream:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: {")]
        text = "".join(
            httpx.Response(200, content=e[6:]).json()["choices"][0]["text"] for e in events
        )
    else:
        text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert text == expected
    after = scrape(http)
    mode = 'tokenmill:router_disagg_requests_total{mode="disaggregated"}'
    assert after[mode] == before.get(mode, 0) + 1
    received = (
        f'tokenmill:kv_transfer_time_seconds_count{{direction="recv"}}{{replica="{decode_url}"}}'
    )
    sent = (
        f'tokenmill:kv_transfer_time_seconds_count{{direction="send"}}{{replica="{prefill_url}"}}'
    )
    assert after[received] == before.get(received, 0) + 1
    assert after[sent] == before.get(sent, 0) + 1
    num_bytes = f'tokenmill:kv_transfer_bytes_sum{{direction="recv"}}{{replica="{decode_url}"}}'
    assert after[num_bytes] > before.get(num_bytes, 0)
    # Nothing stays held on either side once the request is done.
    for url in (prefill_url, decode_url):
        with client_for(url) as instance:
            metrics = wait_for(instance, {"tokenmill:kv_cache_usage_perc": 0})
            assert metrics["tokenmill:kv_cache_usage_perc"] == 0


def test_the_router_and_the_kv_receiver_stay_off_the_decode_cpus(
    server: Server, http: httpx.Client
) -> None:
    """The decode instance's CPUs are its steps' alone: the router streams from the prefill
    instance's, and the decode instance's KV receiving thread runs there too (`recv_cpus`)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: both instances share it")
    prefill_pid, decode_pid = instance_pids(server)
    prefill_cpus, decode_cpus = os.sched_getaffinity(prefill_pid), os.sched_getaffinity(decode_pid)
    assert os.sched_getaffinity(server.process.pid) == prefill_cpus
    http.post(  # a transfer: the receiving thread exists from the first pull on
        "/v1/completions",
        json={"model": MODEL, "prompt": f"{PROMPT} ran", "max_tokens": 2, "temperature": 0},
    ).raise_for_status()
    threads = [int(t) for t in os.listdir(f"/proc/{decode_pid}/task")]
    affinities = [os.sched_getaffinity(t) for t in threads]
    assert prefill_cpus in affinities  # the receiver
    assert decode_cpus in affinities  # the engine and the HTTP server


def test_the_dashboards_show_each_sides_transfers(server: Server, http: httpx.Client) -> None:
    """After a disaggregated request the decode instance's dashboard has the received transfer
    (and the prefill instance's the sent one), with their bytes and seconds."""
    http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": f"{PROMPT} walked", "max_tokens": 2, "temperature": 0},
    ).raise_for_status()
    for url, role, direction, total in zip(
        instance_urls(server),
        ("kv_producer", "kv_consumer"),
        ("send", "recv"),
        ("kv_bytes_sent", "kv_bytes_loaded"),
    ):
        with client_for(url) as instance:
            setup, (update,) = read_events(instance, 1)
        assert setup["kv_transfer"] == {"connector": "P2pConnector", "role": role}
        transfers = [t for t in update["kv_transfers"] if t[2] == direction and t[5] is None]
        assert transfers and all(t[3] > 0 and t[4] > 0 for t in transfers)
        assert update["totals"][total] >= transfers[-1][3]


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 100_000},  # fits the prefill leg (one token), not the decode leg
        {"max_tokens": -1},
        {"logprobs": "yes"},  # a field only the decode leg gets: the body's validation
        {"stream_options": {"include_usage": True}},  # without `stream`
    ],
    ids=["too-long", "negative-max-tokens", "invalid-field", "stream-options"],
)
def test_a_request_the_decode_instance_refuses_frees_the_prefills_kv(
    server: Server, http: httpx.Client, bad: dict
) -> None:
    """Bad input only the decode instance sees (the prefill leg runs the prompt to one token,
    without the sampling fields): a 400 for the client, and the prefill instance's hold on
    the prompt's KV released at once, not kept for its lease (120 s)."""
    prefill_url, _ = instance_urls(server)
    prompt = f"{PROMPT} {next(iter(bad))}"
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, **bad}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    with client_for(prefill_url) as instance:
        metrics = wait_for(instance, {"tokenmill:kv_cache_usage_perc": 0}, timeout=20)
        assert metrics["tokenmill:kv_cache_usage_perc"] == 0
