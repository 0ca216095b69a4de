"""`--vllm-metric-names`: the engine's metrics also under vLLM's `vllm:` names.

Routers and autoscalers in front of vLLM (llm-d's scheduler, vLLM's router, production-stack,
KEDA rules) read `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and the like by
name. tokenmill's metrics already have vLLM's names and meanings under `tokenmill:`; this
collector copies the families vLLM also has, at each scrape, under `vllm:` (nothing is
counted twice: the copies are read from the same children). tokenmill's own extras (the ITL
target, the cached/computed prompt-token split, ...) stay `tokenmill:` only, so no `vllm:`
name means something vLLM's does not.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tokenmill.metrics.prometheus import PREFIX

VLLM_PREFIX = "vllm:"

# The families vLLM's v1 engine exports under the same name and meaning.
VLLM_FAMILIES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "request_time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
)
# Older names that routers still read: vLLM's v0 called the KV usage gauge this.
VLLM_ALIASES = {"gpu_cache_usage_perc": "kv_cache_usage_perc"}


class VllmNames(Collector):
    """Copies of `registry`'s `tokenmill:` families that vLLM also has, as `vllm:` ones.

    Registered in the registry it reads: a scrape of the registry reaches this collector,
    whose own `registry.collect()` is then skipped by a per-thread guard (no recursion)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._collecting = threading.local()
        registry.register(self)

    def describe(self) -> list[Metric]:
        return []  # names are not reserved: the copies follow whatever the engine exports

    def collect(self) -> Iterator[Metric]:
        if getattr(self._collecting, "active", False):
            return
        self._collecting.active = True
        try:
            families = {m.name: m for m in self._registry.collect()}
        finally:
            self._collecting.active = False
        for name in VLLM_FAMILIES:
            family = families.get(PREFIX + name)
            if family is not None:
                yield _renamed(family, name)
        for alias, name in VLLM_ALIASES.items():
            family = families.get(PREFIX + name)
            if family is not None:
                yield _renamed(family, alias)


def _renamed(family: Metric, name: str) -> Metric:
    old, new = family.name, VLLM_PREFIX + name
    copy = Metric(new, family.documentation, family.type, family.unit)
    copy.samples = [s._replace(name=new + s.name[len(old) :]) for s in family.samples]
    return copy
