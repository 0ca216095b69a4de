"""The pooling engine on a background thread for the server: callers await their requests'
results; the thread schedules and runs steps while any wait. A failed forward fails only the
requests in it (a 500 for them), and the loop carries on."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time

from tokenmill.engine.async_engine import EngineDeadError, EngineStepError
from tokenmill.metrics.pooling import PoolingMetrics
from tokenmill.pooling.engine import PoolingRequest, PoolingResult
from tokenmill.pooling.runner import PoolingInput
from tokenmill.pooling.service import PoolingService

logger = logging.getLogger(__name__)


class PoolingEngineDeadError(EngineDeadError):
    """The pooling loop is not running."""


class PoolingStepError(EngineStepError):
    """The forward this request was in failed."""


_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[PoolingResult]"]


class AsyncPoolingEngine:
    def __init__(self, service: PoolingService, metrics: PoolingMetrics | None = None) -> None:
        self.service = service
        self.engine = service.engine
        self.metrics = metrics
        self._lock = threading.Condition()
        self._waiters: dict[str, _Waiter] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def is_healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="tokenmill-pooling", daemon=True
            )
            self._thread.start()

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._fail_all(PoolingEngineDeadError("the server is shutting down"))

    async def run(self, inputs: list[PoolingInput]) -> list[PoolingResult]:
        """Every input pooled (in order); cancelling the caller aborts those not yet run."""
        if not self.is_healthy:
            raise PoolingEngineDeadError("the pooling engine is not running")
        loop = asyncio.get_running_loop()
        ids = [f"pool-{next(self._ids)}" for _ in inputs]
        futures = [loop.create_future() for _ in inputs]
        with self._lock:
            for request_id, item, future in zip(ids, inputs, futures):
                self._waiters[request_id] = (loop, future)
                self.engine.add(PoolingRequest(request_id, item))
            self._lock.notify_all()
        try:
            return list(await asyncio.gather(*futures))
        finally:
            with self._lock:
                self.engine.abort(set(ids))
                for request_id in ids:
                    self._waiters.pop(request_id, None)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and not self.engine.has_unfinished_requests():
                    self._lock.wait()
                if self._stopped:
                    return
                batch = self.engine.schedule()
                self._gauges(len(batch))
            try:
                start = time.perf_counter()
                results = self.engine.execute(batch)
                self._observe(results, time.perf_counter() - start)
            except Exception as error:  # a bad forward fails its requests, not the server
                logger.exception("a pooling step failed")
                if self.metrics is not None:
                    self.metrics.failed(len(batch))
                for request in batch:
                    self._resolve(
                        request.request_id, PoolingStepError(f"the forward failed: {error}")
                    )
                continue
            for result in results:
                self._resolve(result.request_id, result)
            with self._lock:
                self._gauges(0)

    def _gauges(self, running: int) -> None:
        if self.metrics is not None:
            self.metrics.num_running.set(running)
            self.metrics.num_waiting.set(len(self.engine.waiting))

    def _observe(self, results: list[PoolingResult], seconds: float) -> None:
        if self.metrics is None:
            return
        self.metrics.pooling_forward_seconds.inc(seconds)
        for result in results:
            latency = result.finished_time - result.arrival_time
            self.metrics.finished(result.num_prompt_tokens, latency)

    def _resolve(self, request_id: str, outcome: PoolingResult | BaseException) -> None:
        with self._lock:
            waiter = self._waiters.pop(request_id, None)
        if waiter is None:
            return  # its caller is gone
        loop, future = waiter
        loop.call_soon_threadsafe(_settle, future, outcome)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            waiters, self._waiters = list(self._waiters.values()), {}
        for loop, future in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_settle, future, error)


def _settle(future: asyncio.Future[PoolingResult], outcome: PoolingResult | BaseException) -> None:
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
