"""Stored responses, for `previous_response_id`, GET and DELETE: in memory, bounded by count
(the oldest go first) and by age, as vLLM keeps them (nothing survives a restart)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1000
MAX_AGE_SECONDS = 3600.0


@dataclass
class StoredResponse:
    response: dict[str, Any]  # as returned
    messages: list[dict[str, Any]]  # the conversation through this reply, as chat messages
    stored_at: float


class ResponseStore:
    def __init__(
        self, max_responses: int = MAX_STORED_RESPONSES, max_age: float = MAX_AGE_SECONDS
    ) -> None:
        self.max_responses = max_responses
        self.max_age = max_age
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._expire()
        self._responses[response["id"]] = StoredResponse(response, messages, time.monotonic())
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._responses.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._responses)

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.max_age
        while self._responses:
            oldest = next(iter(self._responses.values()))
            if oldest.stored_at >= cutoff:
                break
            self._responses.popitem(last=False)
