"""The waiting queue, in the order requests should be admitted."""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable, Iterator

from tokenmill.step.request import Request


class RequestQueue:
    """FCFS: arrival order, preempted requests back at the front (they were admitted before
    anyone still waiting). Priority: ordered by (priority, arrival), so a preempted request
    goes straight back to its own place."""

    def __init__(self, by_priority: bool = False) -> None:
        self.by_priority = by_priority
        self._queue: deque[Request] = deque()
        self._sequence = itertools.count()
        self._keys: dict[str, tuple[int, int]] = {}

    def add(self, request: Request) -> None:
        self._keys[request.request_id] = (request.priority, next(self._sequence))
        self._insert(request, front=False)

    def add_preempted(self, request: Request) -> None:
        self._insert(request, front=True)

    def _insert(self, request: Request, front: bool) -> None:
        if self.by_priority:
            bisect.insort(self._queue, request, key=lambda r: self._keys[r.request_id])
        elif front:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def remove_ids(self, request_ids: set[str]) -> None:
        self._queue = deque(r for r in self._queue if r.request_id not in request_ids)
        for request_id in request_ids:
            self._keys.pop(request_id, None)

    def forget(self, request: Request) -> None:
        """Drop the ordering key of a request that has left for good."""
        self._keys.pop(request.request_id, None)

    def head(self, count: int) -> Iterable[Request]:
        return itertools.islice(self._queue, count)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __getitem__(self, index: int) -> Request:
        return self._queue[index]
