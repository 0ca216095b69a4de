"""The step loop on a background thread, with one asyncio stream of outputs per request.

`LLMEngine` is not thread-safe, so the engine thread is its only user: the event loop hands it
adds and aborts as commands, which run between steps (an abort takes effect before the next
step), and the engine thread hands each step's outputs back with one `call_soon_threadsafe`.
A thread rather than a process: torch releases the GIL in its kernels, and on small machines
the IPC of a separate engine process costs more than it saves (docs/server.md has the numbers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from tokenmill.config import EngineConfig
from tokenmill.core.feedback.records import StepRecord
from tokenmill.engine.intake import EngineRequest, PromptType
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.metrics.prometheus import EngineMetrics
from tokenmill.metrics.ring import Ring
from tokenmill.metrics.stats import EngineStats, KVBlockStates, KVTransferRecord
from tokenmill.metrics.stats_logger import StatsLogger
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The step loop has stopped: no request can be served any more."""


class EngineStepError(RuntimeError):
    """A step failed while this request was in it. The engine carries on with the others."""


_Item = RequestOutput | BaseException


class RequestStream:
    """The outputs of the engine requests behind one caller (one HTTP request), as produced.

    Iteration ends once every request has finished. Leaving early (an exception, a cancelled
    task, `abort()`) must abort the rest; use it as `async with` or call `abort()` in a finally.
    """

    def __init__(self, engine: AsyncEngine, request_ids: list[str]) -> None:
        self._engine = engine
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.unfinished = set(request_ids)

    def put(self, item: _Item) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.abort()
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
        return item

    def abort(self) -> None:
        if self.unfinished:
            self._engine.abort(sorted(self.unfinished))
            self.unfinished.clear()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort()


class AsyncEngine:
    """Serves many concurrent callers from one `LLMEngine`; every public method runs on the
    event loop's thread."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: EngineMetrics | None = None,
        log_stats_interval: float | None = 5.0,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.default_sampling = engine.parts.default_sampling  # from generation_config.json
        self.last_stats: EngineStats = engine.get_stats()
        self.metrics = metrics
        if metrics is not None:
            metrics.record_stats(self.last_stats)  # the baseline counters advance from
        self._stats_logger = (
            StatsLogger(log_stats_interval, self.last_stats) if log_stats_interval else None
        )
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # event-loop thread only
        self._num_samples: dict[str, int] = {}  # engine thread only: n of each live request
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self._dead_lock = threading.Lock()
        self._observe_failed = False
        # Called (on the engine thread, or the thread that saw a tensor-parallel worker die)
        # when the engine dies: the server exits so that a supervisor restarts it, rather
        # than answering 503 forever.
        self.on_dead: Callable[[BaseException], None] | None = None
        # A dead tensor-parallel worker kills the engine at once, even while it idles.
        self._executor = engine.parts.executor
        if self._executor is not None:
            self._executor.on_failure = self._die

    # ---- lifecycle (event loop) --------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; outputs are delivered to the calling event loop."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and stop the engine thread."""
        if self._thread is None:
            return
        self._submit(self._stop)
        self._thread.join(timeout)
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError("the engine has shut down"))
        self._streams.clear()
        if not self._thread.is_alive():  # a step still running would wait on the workers
            self.engine.shutdown()

    def fail_open_requests(self, error: BaseException) -> None:
        """End every open request now with `error` (a stream sends it as its last event) and
        abort them in the engine: for a shutdown that cannot wait for them any longer."""
        self._fail_streams(error)
        self._submit(lambda: self._abort(sorted(self._num_samples), "abort"))

    # ---- what the dashboard reads (any thread) -------------------------------------------------

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def step_records(self) -> Ring[StepRecord]:
        """The last steps (one writer, the engine thread; lock-free readers)."""
        return self.engine.step_records

    @property
    def kv_transfers(self) -> Ring[KVTransferRecord] | None:
        """Each request's KV transfer, recently (with a KV connector)."""
        return self.engine.kv_transfers

    def kv_block_states(self, max_cells: int) -> KVBlockStates:
        return self.engine.get_kv_block_states(max_cells)

    @property
    def is_healthy(self) -> bool:
        return (
            self._dead is None
            and not self._stopping
            and self._thread is not None
            and self._thread.is_alive()
        )

    # ---- requests (event loop) ---------------------------------------------------------------

    async def add_requests(self, requests: Sequence[EngineRequest]) -> RequestStream:
        """Queue requests that share one output stream. Raises `InvalidRequestError` (none of
        them is queued then) before any output exists, so callers can still answer 400.
        A stream carries what each request's `output_kind` asks for (the server's, deltas)."""
        self._check_alive()
        if self._thread is None:
            self.start()
        ids = [r.request_id for r in requests]
        stream = RequestStream(self, ids)
        for request_id in ids:
            self._streams[request_id] = stream
        added: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(lambda: self._add(requests, added))
        try:
            await asyncio.wrap_future(added)
        except BaseException:
            self.abort(ids)  # cancelled after the engine took them: they must not run orphaned
            raise
        return stream

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """One request's outputs, as deltas; closing the iterator early aborts the request."""
        request = EngineRequest(
            request_id, prompt, params, time.time(), output_kind=RequestOutputKind.DELTA
        )
        stream = await self.add_requests([request])
        async with stream:
            async for output in stream:
                yield output

    def abort(self, request_ids: Sequence[str]) -> None:
        """Forget the requests now; the engine frees their KV blocks before its next step."""
        ids = [r for r in request_ids if self._streams.pop(r, None) is not None]
        if ids:
            self._submit(lambda: self._abort(ids, "abort"))

    def refuse_kv_transfer_params(self, params: dict[str, Any]) -> None:
        """A request carrying `params` was refused before it was queued (bad input): its KV
        connector lets go of what they point at, on the engine thread."""
        if self._dead is None and not self._stopping:
            self._submit(lambda: self.engine.refuse_kv_transfer_params(params))

    async def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, on the engine thread, between two steps."""
        self._check_alive()
        if self._thread is None:
            self.start()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def command() -> None:
            if done.set_running_or_notify_cancel():
                self.engine.reset_prefix_cache()
                done.set_result(None)

        self._submit(command)
        await asyncio.wrap_future(done)

    def _check_alive(self) -> None:
        started = self._thread is not None
        if self._dead is not None or self._stopping or (started and not self._thread.is_alive()):
            raise EngineDeadError("the engine is not running") from self._dead

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _deliver(self, items: list[tuple[str, _Item]]) -> None:
        """Runs on the event loop: hand each output to its stream."""
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # aborted while the step ran
            if isinstance(item, BaseException) or item.finished:
                del self._streams[request_id]
            stream.put(item)

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._run_commands()
                if self._stopping or self._dead is not None:
                    return
                if self.engine.has_unfinished_requests() or self.engine.has_pending_kv_transfers():
                    self._step()
                else:
                    self._observe([])
                    self._wakeup.wait(self._idle_timeout())
                    self._wakeup.clear()
        except BaseException as e:  # the loop itself broke: nothing can be served any more
            if self._dead is None:
                logger.exception("the engine loop died")
            self._die(e)

    def _die(self, error: BaseException) -> None:
        """The engine cannot serve any more (any thread; the first call counts): health fails,
        every open request ends now with `EngineDeadError`, the loop stops, `on_dead` runs."""
        with self._dead_lock:
            if self._dead is not None:
                return
            self._dead = error
        self._fail_all(EngineDeadError(f"the engine loop died: {error!r}"))
        self._wakeup.set()  # an idle loop wakes and ends
        if self.on_dead is not None:
            self.on_dead(error)

    def _idle_timeout(self) -> float | None:
        return self._stats_logger.seconds_until_due if self._stats_logger else None

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            if self._executor is not None and self._executor.failure is not None:
                raise  # a dead tensor-parallel group fails every later step: the loop dies
            logger.exception("an engine step failed; failing the requests it was running")
            self._fail_step(e)
            return
        for output in outputs:
            if output.finished:
                self._forget(output.request_id)
        self._observe(outputs)  # first: a client that has its answer finds it in /metrics
        if outputs:
            self._send([(o.request_id, o) for o in outputs])

    def _observe(self, outputs: list[RequestOutput]) -> None:
        """Metrics and the stats line. A bug here is logged once and must not stop serving."""
        try:
            self.last_stats = stats = self.engine.get_stats()
            if self.metrics is not None:
                self.metrics.record_outputs(outputs)
                self.metrics.record_stats(stats)
                if self.engine.kv_transfers is not None:
                    self.metrics.record_kv_transfers(self.engine.kv_transfers)
            if self._stats_logger is not None:
                self._stats_logger.maybe_log(stats)
        except Exception:
            if not self._observe_failed:
                logger.exception("recording metrics failed; serving continues")
            self._observe_failed = True

    def _send(self, items: list[tuple[str, _Item]]) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # a closed event loop has nobody to tell
            self._loop.call_soon_threadsafe(self._deliver, items)

    def _add(
        self, requests: Sequence[EngineRequest], added: concurrent.futures.Future[None]
    ) -> None:
        if not added.set_running_or_notify_cancel():
            return
        done: list[str] = []
        try:
            for r in requests:
                self.engine.add(r)
                done.append(r.request_id)
                self._num_samples[r.request_id] = r.params.n
        except Exception as e:
            self._abort(done, reason=None)
            added.set_exception(e)
            return
        added.set_result(None)

    def _abort(self, request_ids: list[str], reason: str | None) -> None:
        live = [r for r in request_ids if r in self._num_samples]
        self.engine.abort_request(live)
        for request_id in live:
            num_samples = self._forget(request_id)
            if reason is not None and self.metrics is not None:
                self.metrics.record_aborted(request_id, num_samples, reason)

    def _forget(self, request_id: str) -> int:
        return self._num_samples.pop(request_id, 0)

    def _fail_step(self, error: Exception) -> None:
        """Fail the requests the broken step was running (all of them if it ran none); abort
        them in the engine so their KV blocks come back, and keep serving the rest."""
        failed = self.engine.running_request_ids() & set(self._num_samples)
        failed = failed or set(self._num_samples)
        self._abort(sorted(failed), "error")
        message = f"the engine failed while running this request: {error!r}"
        self._send([(r, EngineStepError(message)) for r in sorted(failed)])

    def _fail_all(self, error: BaseException) -> None:
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed event loop has nobody to tell
            self._loop.call_soon_threadsafe(self._fail_streams, error)

    def _fail_streams(self, error: BaseException) -> None:
        for stream in set(self._streams.values()):
            stream.put(error)
        self._streams.clear()

    def _stop(self) -> None:
        self._stopping = True
        self._abort(sorted(self._num_samples), "abort")
