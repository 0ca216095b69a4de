"""Prometheus metrics of a pooling server (embeddings, scores), with vLLM's names under
tokenmill's prefix: requests finished, prompt tokens, end-to-end latency, requests waiting and
running, plus the forward passes' time (docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tokenmill.metrics.prometheus import _REQUEST_BUCKETS, _Families

_PROMPT_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]


class PoolingMetrics:
    """Observed from the pooling engine's thread (prometheus-client is thread-safe)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        families = _Families(registry, model_name)
        self.request_success = families.counters_by(
            "request_success",
            "Count of finished requests, by finish reason.",
            "finished_reason",
            ("stop", "error"),
        )
        self.prompt_tokens = families.counter(
            "prompt_tokens", "Number of prefill tokens processed."
        )
        self.request_prompt_tokens = families.histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", _PROMPT_TOKEN_BUCKETS
        )
        self.e2e_latency = families.histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _REQUEST_BUCKETS,
        )
        self.num_running = families.gauge(
            "num_requests_running", "Number of requests in the batch."
        )
        self.num_waiting = families.gauge("num_requests_waiting", "Number of requests waiting.")
        self.pooling_forward_seconds = families.counter(
            "pooling_forward_seconds", "Seconds spent in pooling forward passes."
        )

    def finished(self, num_prompt_tokens: int, latency_seconds: float) -> None:
        self.request_success["stop"].inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.e2e_latency.observe(latency_seconds)

    def failed(self, count: int) -> None:
        self.request_success["error"].inc(count)
