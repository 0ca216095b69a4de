"""Prometheus counters of a KV connector's loads and saves (`KVTransferStats`), made when an
engine first reports them: an engine without a connector exports none."""

from __future__ import annotations

from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter

from tokenmill.metrics.stats import KVTransferStats

# stats field -> (metric name, help); counters get Prometheus's `_total` suffix.
_COUNTERS = {
    "num_loaded_tokens": ("kv_connector_loaded_tokens", "Prompt tokens whose KV was loaded."),
    "num_loaded_blocks": ("kv_connector_loaded_blocks", "KV blocks loaded."),
    "bytes_loaded": ("kv_connector_loaded_bytes", "Bytes of KV loaded."),
    "load_seconds": ("kv_connector_load_seconds", "Seconds spent reading and loading KV."),
    "num_saved_blocks": ("kv_connector_saved_blocks", "KV blocks saved."),
    "bytes_saved": ("kv_connector_saved_bytes", "Bytes of KV saved."),
    "save_seconds": ("kv_connector_save_seconds", "Seconds spent saving KV."),
    "num_corrupt_blocks": (
        "kv_connector_corrupt_blocks",
        "Stored KV blocks that failed their checks (recomputed instead).",
    ),
    "bytes_sent": ("kv_connector_sent_bytes", "Bytes of KV sent to other engines."),
    "send_seconds": ("kv_connector_send_seconds", "Seconds spent gathering and sending KV."),
    "num_failed_transfers": (
        "kv_connector_failed_transfers",
        "KV transfers (sends and loads) that failed.",
    ),
    "num_expired_requests": (
        "kv_connector_expired_requests",
        "Finished prefills whose held KV no consumer pulled within the lease.",
    ),
}
assert set(_COUNTERS) == {f.name for f in fields(KVTransferStats)}


class KVTransferMetrics:
    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str) -> None:
        self.counters: dict[str, Counter] = {
            field: Counter(prefix + name, doc, ["model_name"], registry=registry).labels(
                model_name=model_name
            )
            for field, (name, doc) in _COUNTERS.items()
        }

    def record(self, now: KVTransferStats, before: KVTransferStats | None) -> None:
        for field, counter in self.counters.items():
            amount = getattr(now, field) - (0 if before is None else getattr(before, field))
            counter.inc(max(0, amount))
