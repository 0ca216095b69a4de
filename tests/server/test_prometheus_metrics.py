"""/metrics moves as requests are served, under vLLM's names; the log tells an operator the same."""

from __future__ import annotations

import threading
import time

import httpx
import openai
from server_utils import MODEL, Server, scrape, wait_until_idle

HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
]
COUNTERS = [
    "prompt_tokens_total",
    "prompt_tokens_cached_total",
    "prompt_tokens_computed_total",
    "generation_tokens_total",
    'num_preemptions_total{mode="recompute"}',
    'num_preemptions_total{mode="swap"}',
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after[f"tokenmill:{name}"] - before.get(f"tokenmill:{name}", 0.0)


def test_every_documented_metric_is_exposed(http: httpx.Client) -> None:
    metrics = scrape(http)
    for name in HISTOGRAMS:
        assert f"tokenmill:{name}_count" in metrics and f"tokenmill:{name}_sum" in metrics
    for name in COUNTERS + GAUGES:
        assert f"tokenmill:{name}" in metrics
    for reason in ("stop", "length", "abort", "error"):
        assert f'tokenmill:request_success_total{{finished_reason="{reason}"}}' in metrics
    assert 'model_name="tiny-llama"' in http.get("/metrics").text


def test_counters_and_histograms_move_with_a_request(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    before = wait_until_idle(http)
    completion = client.completions.create(
        model=MODEL, prompt="Count me", max_tokens=6, extra_body={"ignore_eos": True}
    )
    after = wait_until_idle(http)
    assert delta(before, after, "prompt_tokens_total") == completion.usage.prompt_tokens
    assert delta(before, after, "generation_tokens_total") == 6
    assert delta(before, after, 'request_success_total{finished_reason="length"}') == 1
    for name in HISTOGRAMS:
        expected = 5 if name == "inter_token_latency_seconds" else 1  # 6 tokens, 5 gaps
        assert delta(before, after, f"{name}_count") == expected, name
    assert delta(before, after, "e2e_request_latency_seconds_sum") > 0
    ttft = delta(before, after, "time_to_first_token_seconds_sum")
    assert 0 < ttft <= delta(before, after, "e2e_request_latency_seconds_sum")


def test_prefix_cache_counters_count_tokens(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = " ".join(f"cached {i}" for i in range(30))
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    before = wait_until_idle(http)
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    after = wait_until_idle(http)
    cached = completion.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert delta(before, after, "prefix_cache_hits_total") == cached
    assert delta(before, after, "prefix_cache_queries_total") >= completion.usage.prompt_tokens
    # vLLM counts the whole prompt, hits included; the split is in two counters of its own.
    prompt_tokens = completion.usage.prompt_tokens
    assert delta(before, after, "prompt_tokens_total") == prompt_tokens
    assert delta(before, after, "prompt_tokens_cached_total") == cached
    assert delta(before, after, "prompt_tokens_computed_total") == prompt_tokens - cached


def test_prompt_logprobs_requests_are_not_prefix_cache_queries(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    """They bypass the cache (every position's logits are needed), so they looked nothing up."""
    prompt = " ".join(f"scored {i}" for i in range(30))
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    before = wait_until_idle(http)
    scored = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=0
    )
    after = wait_until_idle(http)
    assert delta(before, after, "prefix_cache_queries_total") == 0
    assert delta(before, after, "prompt_tokens_total") == scored.usage.prompt_tokens


def test_no_spec_decode_families_without_speculation(http: httpx.Client) -> None:
    assert "spec_decode" not in http.get("/metrics").text


def test_gauges_show_requests_in_flight(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Keep going", "max_tokens": 240, "ignore_eos": True, "n": 8}
    worker = threading.Thread(target=http.post, args=("/v1/completions",), kwargs={"json": body})
    worker.start()
    running, usage = 0.0, 0.0
    while worker.is_alive():
        metrics = scrape(http)
        running = max(running, metrics["tokenmill:num_requests_running"])
        usage = max(usage, metrics["tokenmill:kv_cache_usage_perc"])
    worker.join()
    assert running == 8  # each of the n samples is a sequence in the batch
    assert usage > 0
    after = wait_until_idle(http)
    assert after["tokenmill:num_requests_running"] == 0
    assert after["tokenmill:kv_cache_usage_perc"] == 0


def test_log_shows_capacity_and_periodic_stats(server: Server, client: openai.OpenAI) -> None:
    assert "KV cache" in server.log and "blocks" in server.log
    assert f"http://127.0.0.1:{server.url.rsplit(':', 1)[1]}" in server.log
    client.completions.create(model=MODEL, prompt="Busy", max_tokens=4)
    deadline = time.monotonic() + 5  # the test server logs stats every second
    while "Avg generation throughput" not in server.log and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(line for line in server.log.splitlines() if "Avg generation throughput" in line)
    for part in ("Avg prompt throughput", "Running:", "Waiting:", "Preempted:", "KV cache usage"):
        assert part in line
