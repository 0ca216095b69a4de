"""`--vllm-metric-names`: the families vLLM also has are exported under `vllm:` beside the
`tokenmill:` ones, with the same values and labels; tokenmill's extras are not."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.entrypoints.cli import build_parser
from tokenmill.metrics.prometheus import EngineMetrics
from tokenmill.metrics.vllm_names import VLLM_FAMILIES, VllmNames


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_vllm_names_mirror_the_engine_metrics() -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "tiny")
    VllmNames(registry)
    metrics.num_waiting.set(3)
    metrics.num_running.set(2)
    metrics.kv_cache_usage.set(0.25)
    metrics.prefix_cache_queries.inc(40)
    metrics.prefix_cache_hits.inc(16)
    metrics.time_to_first_token.observe(0.03)
    samples = scrape(registry)
    label = (("model_name", "tiny"),)
    for name, value in [
        ("num_requests_waiting", 3),
        ("num_requests_running", 2),
        ("kv_cache_usage_perc", 0.25),
        ("prefix_cache_queries_total", 40),
        ("prefix_cache_hits_total", 16),
        ("time_to_first_token_seconds_count", 1),
    ]:
        assert samples[("vllm:" + name, label)] == samples[("tokenmill:" + name, label)] == value
    assert samples[("vllm:gpu_cache_usage_perc", label)] == 0.25  # the older name, too
    bucket = ("vllm:time_to_first_token_seconds_bucket", (("le", "0.04"), ("model_name", "tiny")))
    assert samples[bucket] == 1
    names = {name for name, _ in samples}
    assert not any(n.startswith("vllm:prompt_tokens_cached") for n in names)  # ours only
    vllm_families = {n.removeprefix("vllm:").removesuffix("_total") for n in names}
    assert {"num_requests_waiting", "prompt_tokens", "request_success"} <= vllm_families
    assert "spec_decode_num_drafts" in VLLM_FAMILIES  # present only when the engine speculates


def test_without_the_flag_there_are_no_vllm_names() -> None:
    registry = CollectorRegistry()
    EngineMetrics(registry, "tiny")
    assert not any(name.startswith("vllm:") for name, _ in scrape(registry))
    args = build_parser().parse_args(["serve", "--vllm-metric-names"])
    assert args.vllm_metric_names is True
