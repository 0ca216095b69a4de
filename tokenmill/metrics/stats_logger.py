"""The periodic one-line summary an operator watches in the server log, as `vllm serve` prints."""

from __future__ import annotations

import logging
import time

from tokenmill.metrics.stats import EngineStats

logger = logging.getLogger("tokenmill.stats")


class StatsLogger:
    """Logs throughput and queue state every `interval` seconds while the engine is busy.

    Throughputs are averages over the interval, so a quiet server logs nothing and the first
    line after a burst still covers all of it.
    """

    def __init__(self, interval: float, start: EngineStats) -> None:
        self.interval = interval
        self._last_time = time.monotonic()
        self._last_stats = start  # the baseline of the first interval

    def maybe_log(self, stats: EngineStats) -> None:
        now = time.monotonic()
        if now - self._last_time < self.interval:
            return
        last = self._last_stats
        elapsed = now - self._last_time
        self._last_time, self._last_stats = now, stats
        prompt = stats.num_prompt_tokens - last.num_prompt_tokens
        generation = stats.num_generation_tokens - last.num_generation_tokens
        s = stats.scheduler
        if not (prompt or generation or s.num_running or s.num_waiting):
            return
        logger.info(format_stats_line(stats, last, elapsed))

    @property
    def seconds_until_due(self) -> float:
        return max(0.0, self.interval - (time.monotonic() - self._last_time))


def format_stats_line(stats: EngineStats, last: EngineStats, elapsed: float) -> str:
    s = stats.scheduler
    prompt = (stats.num_prompt_tokens - last.num_prompt_tokens) / elapsed
    generation = (stats.num_generation_tokens - last.num_generation_tokens) / elapsed
    preempted = s.num_preemptions - last.scheduler.num_preemptions
    parts = [
        f"Avg prompt throughput: {prompt:.1f} tokens/s",
        f"Avg generation throughput: {generation:.1f} tokens/s",
        f"Running: {s.num_running} reqs",
        f"Waiting: {s.num_waiting} reqs",
        f"Preempted: {preempted} reqs",
        f"KV cache usage: {100 * s.kv_cache_usage:.1f}%",
    ]
    hit_rate = _prefix_cache_hit_rate(stats, last)
    if hit_rate is not None:
        parts.append(f"Prefix cache hit rate: {100 * hit_rate:.1f}%")
    spec, spec_before = s.spec_decode, last.scheduler.spec_decode
    if spec is not None and spec_before is not None and spec.num_drafts > spec_before.num_drafts:
        accepted = spec.num_accepted_tokens - spec_before.num_accepted_tokens
        drafts = spec.num_drafts - spec_before.num_drafts
        parts.append(f"Mean acceptance length: {1 + accepted / drafts:.2f}")
    kv, kv_before = stats.kv_transfer, last.kv_transfer
    if kv is not None:
        loaded = kv.num_loaded_tokens - (kv_before.num_loaded_tokens if kv_before else 0)
        saved = kv.num_saved_blocks - (kv_before.num_saved_blocks if kv_before else 0)
        if loaded or saved:
            parts.append(f"KV connector: {loaded} tokens loaded, {saved} blocks saved")
    return ", ".join(parts)


def _prefix_cache_hit_rate(stats: EngineStats, last: EngineStats) -> float | None:
    """Over the interval's lookups (since start if it had none); None with caching off."""
    now, before = stats.scheduler.prefix_cache, last.scheduler.prefix_cache
    if not now.queries:
        return None
    if now.queries == before.queries:
        return now.hit_rate
    return (now.hits - before.hits) / (now.queries - before.queries)
