"""Prefix caching and speculative decoding as a client sees them: cached_tokens in usage,
cache_salt, /reset_prefix_cache, priority ordering, and the spec-decode metrics."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_clients import openai_client
from server_utils import (
    API_KEY,
    MODEL,
    Server,
    scrape,
    start_server,
    stop_server,
)

# 64 distinct words, so the prompt spans several 16-token blocks.
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi"


def unique_prompt() -> str:
    return f"{uuid.uuid4().hex} " + " ".join([WORDS] * 4)


def cached_tokens(client: openai.OpenAI, prompt: str, **extra) -> int:
    completion = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra or None
    )
    details = completion.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def test_a_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = unique_prompt()
    assert cached_tokens(client, prompt) == 0
    assert cached_tokens(client, prompt) > 0


def test_cache_salt_keeps_tenants_apart(client: openai.OpenAI) -> None:
    prompt = unique_prompt()
    assert cached_tokens(client, prompt, cache_salt="tenant-a") == 0
    assert cached_tokens(client, prompt, cache_salt="tenant-b") == 0
    assert cached_tokens(client, prompt) == 0
    assert cached_tokens(client, prompt, cache_salt="tenant-a") > 0


def test_reset_prefix_cache_forgets_prefixes(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = unique_prompt()
    cached_tokens(client, prompt)
    assert http.post("/reset_prefix_cache").status_code == 200
    assert cached_tokens(client, prompt) == 0


PRIORITY_MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def priority_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One request at a time, so the waiting queue's order is the order requests finish in. A
    long context, so the blocking request outlasts the test's set-up on any machine."""
    log_path = tmp_path_factory.mktemp("priority-server") / "server.log"
    args = ["--scheduling-policy", "priority", "--max-num-seqs", "1"]
    args += ["--max-model-len", str(PRIORITY_MAX_MODEL_LEN)]
    server = start_server(model_dir, log_path, *args)
    yield server
    stop_server(server)


def test_priority_orders_the_waiting_queue(priority_server: Server) -> None:
    """While a long request runs, a low-priority request arrives, then a high-priority one
    (lower value first): the later, higher-priority request runs first. Under fcfs the
    low-priority one would, having arrived first."""
    client = openai_client(priority_server)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    http = httpx.Client(base_url=priority_server.url, headers=headers, timeout=60)
    finished: list[str] = []

    def complete(name: str, max_tokens: int, priority: int) -> None:
        extra = {"priority": priority, "ignore_eos": True}
        client.completions.create(model=MODEL, prompt=name, max_tokens=max_tokens, extra_body=extra)
        finished.append(name)

    def wait_for(running: int, waiting: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            metrics = scrape(http)
            if (
                metrics["tokenmill:num_requests_running"] == running
                and metrics["tokenmill:num_requests_waiting"] == waiting
            ):
                return
            time.sleep(0.01)
        raise AssertionError(f"never {running} running and {waiting} waiting")

    # The blocker streams until the test closes it: aborting it frees the one slot only once
    # both others wait, however fast the machine decodes.
    blocker = client.completions.create(
        model=MODEL, prompt="blocker", max_tokens=PRIORITY_MAX_MODEL_LEN - 16, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    with ThreadPoolExecutor(2) as pool, http, blocker:
        next(iter(blocker))
        wait_for(running=1, waiting=0)
        jobs = [pool.submit(complete, "low", 32, 10)]
        wait_for(running=1, waiting=1)
        jobs.append(pool.submit(complete, "high", 32, 0))
        wait_for(running=1, waiting=2)
        blocker.close()
        for job in jobs:
            job.result()
    # (32 steps apart, so the client threads' timing cannot swap them)
    assert finished.index("high") < finished.index("low")


@pytest.fixture(scope="module")
def spec_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("spec-server") / "server.log"
    config = '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}'
    server = start_server(model_dir, log_path, "--speculative-config", config)
    yield server
    stop_server(server)


def test_speculative_decoding_metrics_move(spec_server: Server, client: openai.OpenAI) -> None:
    spec_client = openai_client(spec_server)
    prompt = " ".join([WORDS] * 3)
    args = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    fast = spec_client.completions.create(**args, extra_body={"ignore_eos": True})
    plain = client.completions.create(**args, extra_body={"ignore_eos": True})
    assert fast.choices[0].text == plain.choices[0].text
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=spec_server.url, headers=keyed) as http:
        metrics = scrape(http)
    drafts = metrics["tokenmill:spec_decode_num_draft_tokens_total"]
    accepted = metrics["tokenmill:spec_decode_num_accepted_tokens_total"]
    assert metrics["tokenmill:spec_decode_num_drafts_total"] > 0
    assert drafts > 0 and 0 <= accepted <= drafts
    per_position = [v for k, v in metrics.items() if "accepted_tokens_per_pos_total" in k]
    assert sum(per_position) == accepted
