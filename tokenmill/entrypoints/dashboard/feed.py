"""What the dashboard page receives: its set-up once, then a few times a second what is new.

Everything comes from statistics the engine keeps anyway (the last step's `EngineStats`, the
rings of step records and latency observations, O(1) block counts), read on the event loop
while the engine thread keeps stepping: a reader never blocks or slows a step. Rings are sent
incrementally (each record once per page), cumulative totals as they stand; the page computes
rates, percentiles and goodput over its own sliding window.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.metrics.ring import Ring

UPDATES_PER_SECOND = 4
# A page that connects gets this much history: the longest window it offers.
MAX_WINDOW_SECONDS = 300.0
# Block map cells: above this many blocks the map shows every k-th one.
MAX_MAP_CELLS = 2048


class DashboardFeed:
    """One page's view: where it is in each ring."""

    def __init__(self, engine: AsyncEngine, model_name: str, slos: dict[str, float]) -> None:
        self._engine = engine
        self._model_name = model_name
        self._slos = slos
        recent = engine.metrics.recent if engine.metrics is not None else None
        self._rings: dict[str, Ring[Any]] = {"steps": self._engine.step_records}
        if recent is not None:
            self._rings |= {"ttft": recent.ttft, "itl": recent.itl, "finished": recent.finished}
        if engine.kv_transfers is not None:  # a KV connector: each request's transfer
            self._rings["kv_transfers"] = engine.kv_transfers
        self._cursors = dict.fromkeys(self._rings, 0)
        self._first = True

    def setup(self) -> dict[str, Any]:
        """What does not change while the server runs."""
        config = self._engine.config
        spec = config.speculative_config
        return {
            "model": self._model_name,
            "weight_format": self._engine.engine.parts.weight_format,  # as /v1/models reports it
            "slo": self._slos,
            "window_seconds_max": MAX_WINDOW_SECONDS,
            "updates_per_second": UPDATES_PER_SECOND,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_num_seqs": config.max_num_seqs,
            "block_size": config.block_size,
            "prefix_caching": config.enable_prefix_caching,
            "speculative": None
            if spec is None
            else {"method": spec.method, "max_k": spec.num_speculative_tokens},
            "kv_transfer": None
            if (kv := config.kv_transfer_config) is None
            else {"connector": kv.kv_connector, "role": kv.kv_role},
        }

    def update(self) -> dict[str, Any]:
        now = time.time()
        update: dict[str, Any] = {"now": now, **self._new_records(now)}
        stats = self._engine.last_stats
        s = stats.scheduler
        kv = self._engine.kv_block_states(MAX_MAP_CELLS)
        update["totals"] = {
            "num_steps": stats.num_steps,
            "prompt_tokens": stats.num_prompt_tokens,  # whole prompts, as /metrics counts
            "computed_prompt_tokens": stats.num_computed_prompt_tokens,  # cache hits left out
            "generation_tokens": stats.num_generation_tokens,
            "preemptions": s.num_preemptions,
            "prefix_cache_queries": s.prefix_cache.queries,
            "prefix_cache_hits": s.prefix_cache.hits,
            "first_tokens": self._total("ttft"),
            "finished_requests": self._total("finished"),
        }
        if s.spec_decode is not None:
            update["totals"] |= {
                "spec_drafts": s.spec_decode.num_drafts,
                "spec_draft_tokens": s.spec_decode.num_draft_tokens,
                "spec_accepted_tokens": s.spec_decode.num_accepted_tokens,
            }
        if stats.kv_transfer is not None:
            transfer = stats.kv_transfer
            update["totals"] |= {
                "kv_bytes_loaded": transfer.bytes_loaded,
                "kv_bytes_sent": transfer.bytes_sent,
                "kv_failed_transfers": transfer.num_failed_transfers,
                "kv_expired_requests": transfer.num_expired_requests,
            }
        update["queues"] = {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "swapped": kv.num_swapped_reqs,
        }
        update["kv"] = asdict(kv)
        return update

    def _new_records(self, now: float) -> dict[str, list[Any]]:
        """Each ring's records this page has not had; on the first call, the window's worth."""
        new = {}
        for name, ring in self._rings.items():
            records, self._cursors[name] = ring.since(self._cursors[name])
            if self._first:
                records = [r for r in records if r[0] >= now - MAX_WINDOW_SECONDS]
            new[name] = records
        self._first = False
        return new

    def _total(self, name: str) -> int | None:
        ring = self._rings.get(name)
        return None if ring is None else ring.num_appended
