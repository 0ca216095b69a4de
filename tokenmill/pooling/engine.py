"""The pooling engine: continuous batching of embedding and scoring requests under a token
budget, with no KV cache kept between steps.

A pooling request is one forward: it has no decode phase, so it needs none of the generative
engine's machinery (KV blocks, preemption, sampling, detokenizing, stop checks). Each step
takes waiting requests in arrival order while their tokens fit `max_num_batched_tokens` and
their number `max_num_seqs` (a request longer than the budget runs alone), runs one forward,
and finishes every request in it; requests that arrive meanwhile join the next step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tokenmill.pooling.runner import PoolingInput, PoolingRunner


@dataclass
class PoolingRequest:
    request_id: str
    input: PoolingInput
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class PoolingResult:
    """A finished pooling request: its output tensor (an embedding or a 0-d score)."""

    request_id: str
    data: torch.Tensor
    num_prompt_tokens: int
    arrival_time: float
    finished_time: float


@dataclass
class PoolingStats:
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_steps: int = 0
    forward_seconds: float = 0.0


class PoolingEngine:
    def __init__(
        self, runner: PoolingRunner, max_num_batched_tokens: int, max_num_seqs: int
    ) -> None:
        self.runner = runner
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[PoolingRequest] = deque()
        self.stats = PoolingStats()

    def add(self, request: PoolingRequest) -> None:
        if not request.input.token_ids:
            raise ValueError("a pooling request needs at least one token")
        self.waiting.append(request)

    def abort(self, request_ids: set[str]) -> None:
        self.waiting = deque(r for r in self.waiting if r.request_id not in request_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def schedule(self) -> list[PoolingRequest]:
        """The next step's requests: the oldest first, while they fit the budgets."""
        batch: list[PoolingRequest] = []
        tokens = 0
        while self.waiting and len(batch) < self.max_num_seqs:
            size = len(self.waiting[0].input.token_ids)
            if batch and tokens + size > self.max_num_batched_tokens:
                break
            batch.append(self.waiting.popleft())
            tokens += size
        return batch

    def step(self) -> list[PoolingResult]:
        return self.execute(self.schedule())

    def execute(self, batch: list[PoolingRequest]) -> list[PoolingResult]:
        """One forward over a scheduled batch; every request in it finishes."""
        if not batch:
            return []
        # Sorted by length, an encoder's padding stays small; outputs go back by request.
        order = sorted(range(len(batch)), key=lambda i: len(batch[i].input.token_ids))
        start = time.perf_counter()
        outputs = self.runner.run([batch[i].input for i in order])
        self.stats.forward_seconds += time.perf_counter() - start
        now = time.monotonic()
        results = [
            PoolingResult(
                batch[i].request_id,
                output,
                len(batch[i].input.token_ids),
                batch[i].arrival_time,
                now,
            )
            for i, output in zip(order, outputs)
        ]
        self.stats.num_steps += 1
        self.stats.num_requests += len(results)
        self.stats.num_prompt_tokens += sum(r.num_prompt_tokens for r in results)
        return results
