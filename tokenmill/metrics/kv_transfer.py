"""Prometheus metrics of a KV connector, made when an engine first reports them (an engine
without a connector exports none): counters of its loads, saves and sends
(`KVTransferStats`), and per request, histograms of each transfer's time and bytes and a
count of failures by kind (vLLM's NIXL connector's `nixl_xfer_time_seconds`,
`nixl_bytes_transferred`, `nixl_num_failed_transfers`)."""

from __future__ import annotations

from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Histogram

from tokenmill.metrics.ring import Ring
from tokenmill.metrics.stats import KVTransferRecord, KVTransferStats

_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(1, 12))  # 4 KiB .. 4 GiB
DIRECTIONS = ("send", "recv")

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
        labels = ["model_name", "direction"]
        time_family = Histogram(
            prefix + "kv_transfer_time_seconds",
            "Time of one request's KV transfer (send: gather and send; recv: connect, "
            "receive, verify and write into the cache), by direction.",
            labels,
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
        bytes_family = Histogram(
            prefix + "kv_transfer_bytes",
            "Bytes of one request's KV transfer, by direction.",
            labels,
            buckets=_BYTES_BUCKETS,
            registry=registry,
        )
        self.seconds = {d: time_family.labels(model_name, d) for d in DIRECTIONS}
        self.bytes = {d: bytes_family.labels(model_name, d) for d in DIRECTIONS}
        self.failures = Counter(
            prefix + "kv_transfer_failures",
            "KV transfers that failed, by direction and kind (refused, checksum, timeout, "
            "connection).",
            ["model_name", "direction", "reason"],
            registry=registry,
        )
        self._model_name = model_name
        self._cursor = 0

    def record_transfers(self, ring: Ring[KVTransferRecord]) -> None:
        """The transfers the ring holds that were not recorded yet."""
        records, self._cursor = ring.since(self._cursor)
        for record in records:
            if record.error is not None:
                reason = record.reason or "connection"
                self.failures.labels(self._model_name, record.direction, reason).inc()
            elif record.direction in DIRECTIONS:
                self.seconds[record.direction].observe(record.seconds)
                self.bytes[record.direction].observe(record.num_bytes)

    def record(self, now: KVTransferStats, before: KVTransferStats | None) -> None:
        for field, counter in self.counters.items():
            amount = getattr(now, field) - (0 if before is None else getattr(before, field))
            counter.inc(max(0, amount))
