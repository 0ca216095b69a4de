"""The waiting queue, in the order requests should be admitted, and which one is next."""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Iterator

from tokenmill.core.kv.cache_manager import KVCacheManager
from tokenmill.step.request import Request

# Cache-aware admission looks this far down the waiting queue for the request with the most
# prompt tokens already in the prefix cache...
CACHE_AWARE_WINDOW = 8
# ...but the request at the head is passed over at most this many times, so the oldest request
# waits for no more than this many extra admissions (a few steps) and never starves.
MAX_HEAD_SKIPS = 4


class RequestQueue:
    """FCFS: arrival order, preempted requests back at the front (they were admitted before
    anyone still waiting). Priority: ordered by (priority, arrival), so a preempted request
    goes straight back to its own place.

    Ahead of either, in the order they came: requests that already hold blocks (a KV
    connector loaded their prompt into them). Such a request needs a block at most, and its
    blocks come back only once it has run; behind a head that cannot fit beside them (one
    preempted for memory after their KV arrived) it would wait on that head for ever."""

    def __init__(self, by_priority: bool = False) -> None:
        self.by_priority = by_priority
        self._holding: deque[Request] = deque()
        self._queue: deque[Request] = deque()
        self._sequence = itertools.count()
        self._keys: dict[str, tuple[int, int]] = {}
        # Whether a request may be admitted now beyond its grammar (LoRA: its adapter gets a
        # slot; core/sched/lora_admission.py); one that may not is passed over in place.
        self.admissible: Callable[[Request], bool] | None = None

    def add(self, request: Request) -> None:
        self._keys[request.sample_id] = (request.priority, next(self._sequence))
        self._insert(request, front=False)

    def add_preempted(self, request: Request) -> None:
        self._insert(request, front=True)

    def add_holding_blocks(self, request: Request) -> None:
        """A request admitted before, back with its blocks (its KV loaded): next in line."""
        self._holding.append(request)

    def _insert(self, request: Request, front: bool) -> None:
        if self.by_priority:
            bisect.insort(self._queue, request, key=lambda r: self._keys[r.sample_id])
        elif front:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)

    def next_to_admit(self, manager: KVCacheManager) -> Request | None:
        """The next request to admit: the head of the queue, unless one of the next few (of
        the same priority) has more of its prompt in the prefix cache. Serving it now, while
        its prefix is cached, saves recomputing that prefix after an eviction. Requests whose
        grammar is still compiling, or that are not `admissible`, are passed over (they keep
        their place)."""
        holder = next((r for r in self._holding if self._ready(r)), None)
        if holder is not None:
            return holder
        head = next((r for r in self._queue if self._ready(r)), None)
        if (
            head is None
            or not manager.enable_caching
            or head.num_skips >= MAX_HEAD_SKIPS
            or len(self) < 2
        ):
            return head
        best, best_hits = head, -1
        for candidate in itertools.islice(self._queue, CACHE_AWARE_WINDOW):
            if (
                candidate.priority != head.priority
                or manager.is_swapped(candidate)
                or not self._ready(candidate)
            ):
                continue
            num_hits = manager.get_computed_blocks(candidate)[1]
            if num_hits > best_hits:
                best, best_hits = candidate, num_hits
        if best is not head:
            head.num_skips += 1
        return best

    def _ready(self, request: Request) -> bool:
        return _grammar_ready(request) and (self.admissible is None or self.admissible(request))

    def remove(self, request: Request) -> None:
        if request in self._holding:
            self._holding.remove(request)
        else:
            self._queue.remove(request)

    def remove_ids(self, sample_ids: set[str]) -> None:
        self._holding = deque(r for r in self._holding if r.sample_id not in sample_ids)
        self._queue = deque(r for r in self._queue if r.sample_id not in sample_ids)
        for sample_id in sample_ids:
            self._keys.pop(sample_id, None)

    def forget(self, request: Request) -> None:
        """Drop the ordering key of a request that has left for good."""
        self._keys.pop(request.sample_id, None)

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain(self._holding, self._queue)

    def __len__(self) -> int:
        return len(self._holding) + len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._holding or self._queue)

    def __getitem__(self, index: int) -> Request:
        return next(itertools.islice(self, index, None))


def _grammar_ready(request: Request) -> bool:
    """May be admitted: no grammar, or one compiled (a failed one is finished instead)."""
    grammar = request.grammar
    return grammar is None or (grammar.is_ready() and grammar.error is None)
