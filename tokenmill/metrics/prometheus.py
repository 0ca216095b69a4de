"""Prometheus metrics with vLLM's names and meanings, under a `tokenmill:` prefix.

Dashboards and benchmark tools written for `vllm serve` read these unchanged once the prefix is
swapped. Every metric carries a `model_name` label, as vLLM's do. See docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.metrics.itl_target import ItlTargetCollector
from tokenmill.metrics.kv_transfer import KVTransferMetrics
from tokenmill.metrics.recent import FinishedRecord, RecentLatencies
from tokenmill.metrics.ring import Ring
from tokenmill.metrics.stats import EngineStats, KVTransferRecord, SpecDecodeStats
from tokenmill.outputs import RequestOutput

PREFIX = "tokenmill:"

# vLLM's buckets, so a dashboard's histogram_quantile reads the same resolution.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0]  # fmt: skip
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip

FINISHED_REASONS = ("stop", "length", "abort", "error")


@dataclass
class _Progress:
    """What the metrics remember of a request between its delta outputs."""

    last_token_time: float | None = None
    num_tokens: dict[int, int] = field(default_factory=dict)  # per sample index
    num_finished: int = 0  # samples that have finished


@dataclass(frozen=True)
class _Families:
    """Makes metric families in `registry`, each with a `model_name` label, and returns their
    children for this model (as vLLM labels every metric)."""

    registry: CollectorRegistry
    model_name: str

    def histogram(self, name: str, doc: str, buckets: list[float]) -> Histogram:
        family = Histogram(
            PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry
        )
        return family.labels(model_name=self.model_name)

    def counter(self, name: str, doc: str) -> Counter:
        family = Counter(PREFIX + name, doc, ["model_name"], registry=self.registry)
        return family.labels(model_name=self.model_name)

    def gauge(self, name: str, doc: str) -> Gauge:
        family = Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry)
        return family.labels(model_name=self.model_name)

    def labelled_counter(self, name: str, doc: str, label: str) -> Counter:
        """A counter family with one label besides `model_name` (children made by caller)."""
        return Counter(PREFIX + name, doc, ["model_name", label], registry=self.registry)

    def counters_by(
        self, name: str, doc: str, label: str, values: tuple[str, ...]
    ) -> dict[str, Counter]:
        family = self.labelled_counter(name, doc, label)
        return {v: family.labels(model_name=self.model_name, **{label: v}) for v in values}


class EngineMetrics:
    """Owns the metrics and turns engine outputs and stats into observations.

    Called from the engine thread only (prometheus-client is thread-safe for the scrape).
    """

    def __init__(
        self, registry: CollectorRegistry, model_name: str, spec_decode: bool = False
    ) -> None:
        """`spec_decode`: the engine speculates, so export the `spec_decode_*` families
        (a server without speculation has none, as in vLLM)."""
        self.registry = registry
        self._progress: dict[str, _Progress] = {}
        self._last_stats: EngineStats | None = None
        self.recent = RecentLatencies()  # the same observations, timed, for the dashboard
        families = _Families(registry, model_name)
        self._add_latency_histograms(families)
        self._add_token_counters(families)
        self.preemptions = families.counters_by(
            "num_preemptions",
            "Cumulative number of preemptions, by mode (recompute or swap).",
            "mode",
            ("recompute", "swap"),
        )
        self.spec_decode = _SpecDecodeMetrics(families) if spec_decode else None
        self.prefix_cache_queries = families.counter(
            "prefix_cache_queries", "Prefix cache lookups, in prompt tokens looked up."
        )
        self.prefix_cache_hits = families.counter(
            "prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached."
        )
        self.request_success = families.counters_by(
            "request_success",
            "Count of finished requests, by finish reason.",
            "finished_reason",
            FINISHED_REASONS,
        )
        self.num_running = families.gauge(
            "num_requests_running", "Number of requests in the batch."
        )
        self.num_waiting = families.gauge("num_requests_waiting", "Number of requests waiting.")
        self.kv_cache_usage = families.gauge(
            "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.itl_target = ItlTargetCollector(PREFIX, model_name)
        registry.register(self.itl_target)
        self._model_name = model_name
        self.kv_transfer: KVTransferMetrics | None = None  # made when a connector reports

    def _add_latency_histograms(self, families: _Families) -> None:
        histogram = families.histogram
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", _ITL_BUCKETS
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Decode time of a finished request divided by its output tokens after the first.",
            _ITL_BUCKETS,
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to finish.", _REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time from arrival to first being scheduled.",
            _REQUEST_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Time from first being scheduled to the first token.",
            _REQUEST_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "Time from the first token to the last token.",
            _REQUEST_BUCKETS,
        )

    def _add_token_counters(self, families: _Families) -> None:
        self.prompt_tokens = families.counter(
            "prompt_tokens", "Number of prefill tokens processed (whole prompts, as vLLM)."
        )
        self.prompt_tokens_cached = families.counter(
            "prompt_tokens_cached", "Number of prompt tokens found in the prefix cache."
        )
        self.prompt_tokens_computed = families.counter(
            "prompt_tokens_computed",
            "Number of prompt tokens run through the model (again after a preemption).",
        )
        self.generation_tokens = families.counter(
            "generation_tokens", "Number of generation tokens processed."
        )

    # ---- engine thread ----------------------------------------------------------------------

    def record_stats(self, stats: EngineStats) -> None:
        """Counters advance by what the engine did since the last call; gauges take its state."""
        last = self._last_stats
        if last is not None:
            s, before = stats.scheduler, last.scheduler
            _advance(self.prompt_tokens, stats.num_prompt_tokens - last.num_prompt_tokens)
            _advance(
                self.prompt_tokens_cached,
                stats.num_cached_prompt_tokens - last.num_cached_prompt_tokens,
            )
            _advance(
                self.prompt_tokens_computed,
                stats.num_computed_prompt_tokens - last.num_computed_prompt_tokens,
            )
            _advance(
                self.generation_tokens, stats.num_generation_tokens - last.num_generation_tokens
            )
            for mode, counter in self.preemptions.items():
                _advance(
                    counter,
                    s.num_preemptions_by_mode.get(mode, 0)
                    - before.num_preemptions_by_mode.get(mode, 0),
                )
            spec, spec_before = s.spec_decode, before.spec_decode
            if self.spec_decode is not None and spec is not None and spec_before is not None:
                self.spec_decode.record(spec, spec_before)
            _advance(
                self.prefix_cache_queries, s.prefix_cache.queries - before.prefix_cache.queries
            )
            _advance(self.prefix_cache_hits, s.prefix_cache.hits - before.prefix_cache.hits)
        self._record_kv_transfer(stats, last)
        self._last_stats = stats
        self.itl_target.stats = stats.scheduler.itl_target
        self.num_running.set(stats.scheduler.num_running)
        self.num_waiting.set(stats.scheduler.num_waiting)
        self.kv_cache_usage.set(stats.scheduler.kv_cache_usage)

    def _record_kv_transfer(self, stats: EngineStats, last: EngineStats | None) -> None:
        if stats.kv_transfer is None:
            return
        self._kv_transfer_metrics().record(
            stats.kv_transfer, None if last is None else last.kv_transfer
        )

    def record_kv_transfers(self, ring: Ring[KVTransferRecord]) -> None:
        """Each request's KV transfer the engine recorded since the last call."""
        self._kv_transfer_metrics().record_transfers(ring)

    def _kv_transfer_metrics(self) -> KVTransferMetrics:
        if self.kv_transfer is None:
            self.kv_transfer = KVTransferMetrics(self.registry, PREFIX, self._model_name)
        return self.kv_transfer

    def record_outputs(self, outputs: list[RequestOutput]) -> None:
        """Latency observations from one step's delta outputs."""
        for output in outputs:
            self._record_output(output)

    def record_aborted(self, request_id: str, num_samples: int, reason: str = "abort") -> None:
        """A request that ends without a final output (client gone, or a failed step)."""
        progress = self._progress.pop(request_id, None)
        num_finished = progress.num_finished if progress is not None else 0
        self.request_success[reason].inc(num_samples - num_finished)

    def _record_output(self, output: RequestOutput) -> None:
        metrics = output.metrics
        progress = self._progress.setdefault(output.request_id, _Progress())
        for completion in output.outputs:
            count = progress.num_tokens.get(completion.index, 0)
            progress.num_tokens[completion.index] = count + len(completion.token_ids)
            if completion.finish_reason is not None:  # each sample finishes exactly once
                progress.num_finished += 1
                reason = completion.finish_reason
                self.request_success[reason if reason in self.request_success else "error"].inc()
        last = metrics.last_token_time
        if last is not None and last != progress.last_token_time:
            if progress.last_token_time is None:
                ttft = last - metrics.arrival_time
                self.time_to_first_token.observe(ttft)
                self.recent.ttft.append((last, ttft))
            else:
                itl = last - progress.last_token_time
                self.inter_token_latency.observe(itl)
                self.recent.itl.append((last, itl))
            progress.last_token_time = last
        if output.finished:
            del self._progress[output.request_id]
            self._record_finished(output, max(progress.num_tokens.values(), default=0))

    def _record_finished(self, output: RequestOutput, num_tokens: int) -> None:
        m = output.metrics
        record = FinishedRecord.of(m, num_tokens)
        self.recent.finished.append(record)
        self.e2e_latency.observe(record.e2e)
        if record.queue_time is not None:
            self.queue_time.observe(record.queue_time)
            if m.first_token_time is not None and m.first_scheduled_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None and m.last_token_time is not None:
            self.decode_time.observe(m.last_token_time - m.first_token_time)
        if record.tpot is not None:
            self.time_per_output_token.observe(record.tpot)


class _SpecDecodeMetrics:
    """The speculative-decoding counters, registered only when the engine speculates."""

    def __init__(self, families: _Families) -> None:
        self.drafts = families.counter(
            "spec_decode_num_drafts", "Verification steps with drafts, one per request and step."
        )
        self.draft_tokens = families.counter(
            "spec_decode_num_draft_tokens", "Draft tokens proposed."
        )
        self.accepted_tokens = families.counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted."
        )
        self._per_position = families.labelled_counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position within the drafts of a step (0 = first).",
            "position",
        )
        self._model_name = families.model_name

    def record(self, now: SpecDecodeStats, before: SpecDecodeStats) -> None:
        _advance(self.drafts, now.num_drafts - before.num_drafts)
        _advance(self.draft_tokens, now.num_draft_tokens - before.num_draft_tokens)
        _advance(self.accepted_tokens, now.num_accepted_tokens - before.num_accepted_tokens)
        for position, count in enumerate(now.num_accepted_tokens_per_pos):
            previous = before.num_accepted_tokens_per_pos
            old = previous[position] if position < len(previous) else 0
            counter = self._per_position.labels(model_name=self._model_name, position=str(position))
            _advance(counter, count - old)


class ResponseStoreMetrics:
    """The Responses API store's size and evictions (entrypoints/http/responses/store.py)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        num_bytes: Callable[[], float],
        reasons: tuple[str, ...],
    ) -> None:
        """`num_bytes` is read at each scrape; `reasons` label the evictions."""
        families = _Families(registry, model_name)
        self.evictions = families.counters_by(
            "responses_store_evictions",
            "Stored responses evicted before their client deleted them, by reason (bytes: "
            "over --responses-store-max-bytes; count: over 1,000; age: over an hour).",
            "reason",
            reasons,
        )
        self.stored_bytes = families.gauge(
            "responses_store_bytes", "Memory the stored responses take, in bytes."
        )
        self.stored_bytes.set_function(num_bytes)

    def evicted(self, reason: str) -> None:
        self.evictions[reason].inc()


def _advance(counter: Counter, amount: int) -> None:
    """Counters only go up; an engine-side reset must not raise in the engine thread."""
    counter.inc(max(0, amount))
