"""Stored responses, for `previous_response_id`, GET and DELETE: in memory (nothing survives a
restart, as in vLLM), bounded by count, by age and by bytes, the oldest going first.

Each belongs to the API key that stored it (its `owner`; None on a server without keys): any
other key is told it does not exist, as OpenAI answers (404). The byte bound counts the
memory of each response and its conversation (stored_size), so a client cannot grow the
server's memory past it with large inputs or metadata; a chain's shared history is counted in
each of its responses (an overcount, never an undercount)."""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MAX_STORED_RESPONSES = 1000
MAX_AGE_SECONDS = 3600.0
DEFAULT_MAX_STORED_BYTES = 256 * 1024 * 1024

# Why a response left the store before anyone deleted it (the evictions metric's label).
EVICTION_REASONS = ("bytes", "count", "age")


@dataclass
class StoredResponse:
    response: dict[str, Any]  # as returned
    messages: list[dict[str, Any]]  # the conversation through this reply, as chat messages
    stored_at: float
    owner: str | None  # the API key that stored it
    num_bytes: int  # what it counts against the byte bound


class ResponseStore:
    def __init__(
        self,
        max_responses: int = MAX_STORED_RESPONSES,
        max_age: float = MAX_AGE_SECONDS,
        max_bytes: int = DEFAULT_MAX_STORED_BYTES,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        """`on_evict(reason)` is told of each eviction, reason one of EVICTION_REASONS."""
        if max_bytes < 1:
            raise ValueError(f"the responses store's byte limit must be >= 1, got {max_bytes}")
        self.max_responses = max_responses
        self.max_age = max_age
        self.max_bytes = max_bytes
        self.on_evict = on_evict
        self.num_bytes = 0
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(
        self, response: dict[str, Any], messages: list[dict[str, Any]], owner: str | None = None
    ) -> None:
        self._expire()
        size = stored_size(response, messages)
        self.delete(response["id"], owner)  # (ids are unique; a re-put replaces)
        self._responses[response["id"]] = StoredResponse(
            response, messages, time.monotonic(), owner, size
        )
        self.num_bytes += size
        while len(self._responses) > self.max_responses:
            self._evict("count")
        while self.num_bytes > self.max_bytes:
            self._evict("bytes")
        if response["id"] not in self._responses:
            logger.warning(
                "response %s (%d bytes) is larger than the whole store (%d bytes): not kept",
                response["id"], size, self.max_bytes,
            )  # fmt: skip

    def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """The response if `owner` stored it; None for anyone else, as for no response."""
        self._expire()
        stored = self._responses.get(response_id)
        return stored if stored is not None and stored.owner == owner else None

    def delete(self, response_id: str, owner: str | None = None) -> bool:
        """Deletes the response if `owner` stored it; False (nothing done) otherwise."""
        if self.get(response_id, owner) is None:
            return False
        self.num_bytes -= self._responses.pop(response_id).num_bytes
        return True

    def __len__(self) -> int:
        return len(self._responses)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.max_age
        while self._responses:
            oldest = next(iter(self._responses.values()))
            if oldest.stored_at >= cutoff:
                break
            self._evict("age")

    def _evict(self, reason: str) -> None:
        _, oldest = self._responses.popitem(last=False)
        self.num_bytes -= oldest.num_bytes
        if self.on_evict is not None:
            self.on_evict(reason)


def stored_size(response: dict[str, Any], messages: list[dict[str, Any]]) -> int:
    """The memory a stored response and its conversation take: every object in them, as
    `sys.getsizeof` counts it (an object shared with another response, such as a chain's
    history, is counted in each), so that small objects' overhead counts too."""
    size = 0
    pending: list[Any] = [response, messages]
    while pending:
        item = pending.pop()
        size += sys.getsizeof(item)
        if isinstance(item, dict):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return size
