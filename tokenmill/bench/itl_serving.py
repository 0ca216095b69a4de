"""The ITL-under-prefill scenario over HTTP: streams against a server, timed chunk by chunk.

The same scenario as scenario.py's offline engine, against any server that streams
OpenAI `/v1/completions` with token-id prompts and `ignore_eos` (tokenmill serve,
llama-server): `streams` greedy requests with random `stream_prompt`-token prompts stream;
once each has streamed its first token and then `steady_steps` more, one `long_prompt`-token
request (max_tokens 1) arrives; once each stream has a token from after the long prompt's
first token, the streams are cancelled (the server aborts them).

From the client's clock (chunk arrival times, one chunk per token):
- steady ITL: the median gap between a stream's chunks, over every stream, between the
  moment all stream and the long prompt's arrival;
- while admitted: each stream's gaps from the long prompt's arrival through its chunk of the
  step that gave the long prompt its first token (its first chunk at or after that token, or
  less than half a steady gap before it);
  "steps" is the median count of those gaps per stream;
- TTFT of the long prompt, and throughput: its prompt tokens plus the tokens generated in that
  window, over the TTFT;
- steps over target: the server's `tokenmill:itl_steps_over_target_total` counter over the
  window (tokenmill with `--itl-target-ms` only);
- control steady: the same streams' median gap at the same token positions as the window in a
  control run against the same server, without the long prompt (`run_control`). The streams'
  contexts grow through the window (64-token prompts, ~200 tokens more by its end), and so
  does their step: the steady gap before the arrival understates what they would have seen
  had the long prompt never come; the control measures it, position by position
  (`ControlSteps`), and each gap of the window is judged against the control's step at its
  own position (`Run.relative_p99`).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import accumulate, pairwise
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.bench.client import (
    BenchError,
    EndpointConfig,
    get_served_models,
    new_http_client,
    send_request,
)
from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.itl_stats import ControlSteps, Run, percentile
from tokenmill.bench.llamacpp import LlamaServerProcess
from tokenmill.bench.metrics import RequestRecord
from tokenmill.bench.server_process import ServerProcess

OVER_TARGET = "tokenmill:itl_steps_over_target_total"
POLL_S = 0.01  # how often the driver looks at the streams (the chunks are timed as they come)
TIMEOUT_S = 3600.0


@dataclass
class Scenario:
    streams: int = 32
    stream_prompt: int = 64
    stream_max_tokens: int = 2048  # enough to stream through the run; it is cancelled after
    long_prompt: int = 4000
    steady_steps: int = 16
    vocab_size: int = 2048  # prompt ids are drawn from [3, vocab_size)


def chunk_times(record: RequestRecord) -> list[float]:
    """When each token chunk of a (possibly still streaming) request arrived, on the
    benchmark's clock: its first token, then one inter-token gap per later chunk."""
    if record.ttft == 0.0:
        return []
    return list(accumulate(record.itl, initial=record.start_time + record.ttft))


def scenario_run(
    stream_times: list[list[float]],
    all_streaming: float,
    arrival: float,
    first_token: float,
    long_prompt: int,
    steps_over_target: int | None = None,
) -> Run:
    """The row's statistics from each stream's chunk times and the three moments (see the
    module docstring)."""
    steady = [
        end - start
        for times in stream_times
        for start, end in pairwise(times)
        if all_streaming <= start and end <= arrival
    ]
    if not steady:
        raise ValueError("no steady inter-token gap before the long prompt arrived")
    # The streams' chunks of the step that gave the long prompt its token are sent with it, a
    # few ms before or after: half a steady gap early still ends that step's window.
    last_step_end = first_token - statistics.median(steady) / 2
    admitted = [admission_window(times, arrival, last_step_end) for times in stream_times]
    ttft = first_token - arrival
    generated = 1 + sum(len(window) for window in admitted)
    starts = [window_start(times, arrival) for times in stream_times]
    positions = [s + k for s, window in zip(starts, admitted) for k in range(len(window))]
    first = round(statistics.median(starts))
    last = round(statistics.median(s + len(w) - 1 for s, w in zip(starts, admitted)))
    return Run(
        steady=statistics.median(steady),
        admission_itls=[gap for window in admitted for gap in window],
        ttft=ttft,
        throughput=(long_prompt + generated) / ttft,
        steps_over_target=steps_over_target,
        num_steps=round(statistics.median(len(window) for window in admitted)),
        window=(first, last),
        admission_positions=positions,
    )


def window_start(times: list[float], arrival: float) -> int:
    """The index of a stream's first gap that ends after `arrival`."""
    return next(i for i, (_, end) in enumerate(pairwise(times)) if end > arrival)


def admission_window(times: list[float], arrival: float, last_step_end: float) -> list[float]:
    """A stream's gaps that end after `arrival`, through the first that ends at or after
    `last_step_end`."""
    window = []
    for start, end in pairwise(times):
        if end > arrival:
            window.append(end - start)
            if end >= last_step_end:
                return window
    raise ValueError("a stream has no chunk at or after the long prompt's first token")


def completion_request(prompt: list[int], max_tokens: int) -> SampleRequest:
    return SampleRequest(prompt=prompt, prompt_len=len(prompt), expected_output_len=max_tokens)


def endpoint(base_url: str, model: str, extra_body: dict[str, Any] | None = None) -> EndpointConfig:
    """Streamed greedy `/v1/completions` with `ignore_eos` (a field tokenmill and llama-server
    both read), and `extra_body`'s fields."""
    return EndpointConfig(base_url, model, extra_body=extra_body or {}, request_timeout=TIMEOUT_S)


async def steps_over_target(client: httpx.AsyncClient, base_url: str) -> int | None:
    """tokenmill's count of steps over the ITL target; None from a server without it."""
    try:
        response = await client.get(base_url + "/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    values = [
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == OVER_TARGET
    ]
    return round(sum(values)) if values else None


class _Streams:
    """The running stream requests: their records, and a wait that fails when one ends."""

    def __init__(self, tasks: list[asyncio.Task], records: list[RequestRecord]) -> None:
        self.tasks = tasks
        self.records = records

    @classmethod
    def start(
        cls,
        client: httpx.AsyncClient,
        config: EndpointConfig,
        scenario: Scenario,
        rng: random.Random,
        clock_zero: float,
    ) -> _Streams:
        """The scenario's streams, sent: random `stream_prompt`-token prompts from `rng`."""
        records = [
            RequestRecord(i, scenario.stream_prompt, scenario.stream_max_tokens)
            for i in range(scenario.streams)
        ]
        prompts = [
            [rng.randrange(3, scenario.vocab_size) for _ in range(scenario.stream_prompt)]
            for _ in records
        ]
        tasks = [
            asyncio.create_task(
                send_request(
                    client,
                    config,
                    completion_request(prompt, scenario.stream_max_tokens),
                    record,
                    clock_zero,
                )
            )
            for prompt, record in zip(prompts, records)
        ]
        return cls(tasks, records)

    async def wait_until(self, condition: Callable[[], bool], *others: asyncio.Task) -> None:
        while not condition():
            for task, record in zip(self.tasks, self.records):
                if task.done():
                    raise BenchError(
                        f"stream {record.index} ended during the run "
                        f"({record.error or 'finished: raise stream_max_tokens'})"
                    )
            if any(task.done() for task in others) and not condition():
                raise BenchError("the long prompt's request ended without a token")
            await asyncio.sleep(POLL_S)

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()


async def run_scenario(
    base_url: str, scenario: Scenario, seed: int = 0, extra_body: dict[str, Any] | None = None
) -> Run:
    """Drive the scenario against the server at `base_url` (one served model), with
    `extra_body`'s fields in every request."""
    rng = random.Random(seed)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(3, scenario.vocab_size) for _ in range(length)]

    async with new_http_client(TIMEOUT_S, None) as client:
        models = await get_served_models(client, base_url)
        config = endpoint(base_url, models[0]["id"], extra_body)
        clock_zero = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - clock_zero

        streams = _Streams.start(client, config, scenario, rng, clock_zero)
        records, tasks = streams.records, streams.tasks
        try:
            await streams.wait_until(lambda: all(r.ttft > 0.0 for r in records))
            all_streaming = now()
            await streams.wait_until(
                lambda: all(
                    sum(t > all_streaming for t in chunk_times(r)) >= scenario.steady_steps
                    for r in records
                )
            )
            over_before = await steps_over_target(client, base_url)
            long_record = RequestRecord(scenario.streams, scenario.long_prompt, 1)
            long_request = completion_request(prompt(scenario.long_prompt), 1)
            long_task = asyncio.create_task(
                send_request(client, config, long_request, long_record, clock_zero)
            )
            await streams.wait_until(lambda: long_record.ttft > 0.0, long_task)
            arrival = long_record.start_time
            first_token = arrival + long_record.ttft
            await streams.wait_until(
                lambda: all(chunk_times(r)[-1] >= first_token for r in records)
            )
            over_after = await steps_over_target(client, base_url)
            await long_task
        finally:
            streams.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    over = None if over_before is None or over_after is None else over_after - over_before
    return scenario_run(
        [chunk_times(r) for r in records],
        all_streaming,
        arrival,
        first_token,
        scenario.long_prompt,
        over,
    )


async def run_control(
    base_url: str,
    scenario: Scenario,
    window: tuple[int, int],
    seed: int = 1,
    extra_body: dict[str, Any] | None = None,
) -> tuple[float, float, ControlSteps]:
    """The median and p99 gap at token positions `window` (first and last gap index) of
    streams like the scenario's (other prompts) with no long prompt: their own step at those
    contexts, and its own tail (the floor of any p99 there); and their step position by
    position, a little past the window on either side (each stream's window starts and ends
    a position or two from the median's)."""
    rng = random.Random(seed)
    first, last = window
    margin = 2 * ControlSteps.HALF_WIDTH
    async with new_http_client(TIMEOUT_S, None) as client:
        models = await get_served_models(client, base_url)
        config = endpoint(base_url, models[0]["id"], extra_body)
        streams = _Streams.start(client, config, scenario, rng, time.perf_counter())
        records, tasks = streams.records, streams.tasks
        try:
            await streams.wait_until(lambda: all(len(r.itl) > last + margin for r in records))
        finally:
            streams.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    gaps = [gap for r in records for gap in r.itl[first : last + 1]]
    by_position = {
        p: [r.itl[p] for r in records] for p in range(max(0, first - margin), last + margin + 1)
    }
    steps = ControlSteps.from_gaps(by_position)
    return statistics.median(gaps), percentile(gaps, 0.99), steps


def served_run(
    server: ServerProcess, scenario: Scenario, extra_body: dict[str, Any] | None = None
) -> Run:
    """Start `server`, run the scenario against it, then the control (`run_control`), stop it."""
    with server:
        run = asyncio.run(run_scenario(server.base_url, scenario, extra_body=extra_body))
        assert run.window is not None
        control, control_p99, steps = asyncio.run(
            run_control(server.base_url, scenario, run.window, extra_body=extra_body)
        )
    return replace(run, control_steady=control, control_p99=control_p99, control_steps=steps)


def tokenmill_server(model: Path, max_model_len: int, flags: list[str], log: Path) -> ServerProcess:
    args = ["--model", str(model), "--dtype", "float32", "--max-model-len", str(max_model_len)]
    return ServerProcess([*args, *flags], log)


def llama_server(
    bin_dir: Path, gguf: Path, scenario: Scenario, threads: int, flags: list[str], log: Path
) -> LlamaServerProcess:
    """llama-server with one slot per request, each with its own KV cells (the default for a
    given `--parallel`; `-c` is split evenly), enough for the longest request.

    Not `--kv-unified` (one pool for all slots): there every token's attention spans every
    used cell of the pool, masked, so 32 streams beside a 4,000-token prompt made llama-server's
    steps several times slower.
    """
    slot = max(scenario.long_prompt + 1, scenario.stream_prompt + scenario.stream_max_tokens)
    slots = scenario.streams + 1
    args = ["-m", str(gguf), "-t", str(threads), "--parallel", str(slots)]
    args += ["-c", str(slots * (slot + 16)), "--no-webui"]
    return LlamaServerProcess(bin_dir, [*args, *flags], log)
