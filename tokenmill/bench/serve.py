"""`tokenmill bench serve`: an open-loop load generator for any OpenAI-compatible server.

Requests are released by an arrival process (Poisson, or gamma-distributed gaps with
`--burstiness` as the shape; `inf` rate sends all at once), optionally capped by
`--max-concurrency`, each streamed and timed by `client.send_request`. The schedule is drawn
from `--seed` before the run, so two runs (or two servers) see the same arrivals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from tokenmill.bench import plots
from tokenmill.bench.client import (
    ENDPOINTS,
    BenchError,
    EndpointConfig,
    get_served_models,
    new_http_client,
    send_request,
)
from tokenmill.bench.datasets import (
    DatasetConfig,
    SampleRequest,
    add_dataset_args,
    describe,
    generate_dataset,
)
from tokenmill.bench.metrics import (
    DEFAULT_PERCENTILES,
    RequestRecord,
    compute_metrics,
    parse_goodput,
    parse_percentiles,
)
from tokenmill.bench.report import ServeResult, format_report
from tokenmill.bench.server_tokenizer import ServerTokenizer


@dataclass
class LoadSettings:
    """How requests are offered to the server."""

    request_rate: float = math.inf  # requests per second; inf = all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1 = Poisson, < 1 burstier
    max_concurrency: int | None = None  # requests in flight at most (client side)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")

    def describe(self) -> str:
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}/s"
        cap = self.max_concurrency or "none"
        return f"request rate {rate}, burstiness {self.burstiness:g}, max concurrency {cap}"


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float, seed: int
) -> list[float]:
    """When each request is released, in seconds from the start: gaps are gamma(shape =
    burstiness, mean = 1 / rate) as in vLLM, so burstiness 1 is a Poisson process."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()


async def run_benchmark(
    endpoint: EndpointConfig,
    requests: list[SampleRequest],
    load: LoadSettings,
    tokenizer: Any,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    slos: dict[str, float] | None = None,
    show_progress: bool = True,
) -> ServeResult:
    """Offer `requests` to the server under `load` and measure every one."""
    offsets = arrival_offsets(len(requests), load.request_rate, load.burstiness, load.seed)
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    timeout, headers = endpoint.request_timeout, endpoint.headers
    async with new_http_client(timeout, load.max_concurrency, headers) as client:
        await _probe(client, endpoint)
        progress = tqdm(total=len(requests), disable=not show_progress, desc="requests")
        start, cpu_start = time.perf_counter(), time.process_time()

        async def one(index: int, request: SampleRequest) -> RequestRecord:
            record = RequestRecord(
                index, request.prompt_len, request.expected_output_len, request.category
            )
            await asyncio.sleep(max(0.0, start + offsets[index] - time.perf_counter()))
            record.scheduled_time = time.perf_counter() - start
            if limit is None:
                await send_request(client, endpoint, request, record, start)
            else:
                async with limit:
                    await send_request(client, endpoint, request, record, start)
            progress.update(1)
            return record

        records = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - start
        client_cpu = time.process_time() - cpu_start
        progress.close()
    _count_missing_output_tokens(records, tokenizer)
    metrics = compute_metrics(records, duration, percentiles, slos)
    metrics.client_cpu_fraction = client_cpu / duration if duration > 0 else 0.0
    return ServeResult(metrics, list(records))


PROBE = SampleRequest("Hello! How are you today?", 0, 2)


async def _probe(client: Any, endpoint: EndpointConfig) -> None:
    """One short request first, so a wrong URL, model or endpoint fails in a second with the
    server's own words instead of as N failed requests. Its prompt is none of the dataset's,
    so it warms no prefix cache for them."""
    record = RequestRecord(-1, 0, PROBE.expected_output_len)
    await send_request(client, endpoint, PROBE, record, time.perf_counter())
    if not record.success:
        raise BenchError(
            f"test request to {endpoint.base_url}{endpoint.endpoint} failed: {record.error}"
        )


def _count_missing_output_tokens(records: list[RequestRecord], tokenizer: Any) -> None:
    """Servers that report no usage: count the generated text's tokens, as vLLM does."""
    for record in records:
        if record.success and record.output_tokens == 0 and record.generated_text:
            ids = tokenizer(record.generated_text, add_special_tokens=False)["input_ids"]
            record.output_tokens = len(ids)


# ---- command line ----------------------------------------------------------------------------


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """Where to send requests and how to measure them (shared by serve and sweep)."""
    group = parser.add_argument_group("server")
    group.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root URL")
    group.add_argument(
        "--model",
        default=None,
        help="model name to send (default: the first of the server's /v1/models)",
    )
    group.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer: a Hugging Face directory or a GGUF file (default: --model, or "
        "the served model's root, if either is on this machine; else the server's own, over "
        "its /tokenize and /detokenize)",
    )
    add_request_args(parser)
    add_measure_args(parser)
    measure = parser.add_argument_group("output")
    measure.add_argument(
        "--save-result", default=None, metavar="FILE.json", help="write the results as JSON here"
    )
    measure.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots here")
    add_dataset_args(parser)


def add_request_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("requests")
    group.add_argument(
        "--endpoint", default="/v1/completions", choices=ENDPOINTS, help="the route to load"
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get("TOKENMILL_API_KEY"),
        help="bearer token, if the server wants one (default: $TOKENMILL_API_KEY, which "
        "`tokenmill serve` reads too)",
    )
    group.add_argument(
        "--temperature", type=float, default=0.0, help="of every request; 0 = greedy"
    )
    group.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    group.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")


def add_measure_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("measurement")
    group.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000",
    )
    group.add_argument(
        "--percentiles",
        default=",".join(f"{p:g}" for p in DEFAULT_PERCENTILES),
        help="latency percentiles to report, comma-separated",
    )
    group.add_argument("--seed", type=int, default=0, help="dataset and arrival seed")
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_target_args(parser)
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second (Poisson); inf sends all at once",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of arrival gaps: 1 Poisson, <1 burstier, >1 steadier",
    )
    load.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight (default: no cap)",
    )


@dataclass
class Target:
    """Everything resolved once per command: endpoint, tokenizer, requests, measurement."""

    endpoint: EndpointConfig
    tokenizer: Any
    tokenizer_id: str
    requests: list[SampleRequest]
    dataset: DatasetConfig
    percentiles: tuple[float, ...]
    slos: dict[str, float]
    show_progress: bool

    def info(self, load: LoadSettings) -> dict[str, Any]:
        """The JSON result's header: enough to rerun the benchmark."""
        return {
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "backend": "openai",
            "base_url": self.endpoint.base_url,
            "endpoint": self.endpoint.endpoint,
            "model_id": self.endpoint.model,
            "tokenizer_id": self.tokenizer_id,
            "num_prompts": len(self.requests),
            "request_rate": "inf" if math.isinf(load.request_rate) else load.request_rate,
            "burstiness": load.burstiness,
            "max_concurrency": load.max_concurrency,
            "seed": load.seed,
            "dataset": asdict(self.dataset),
            "goodput_slos": self.slos,
            "percentiles": list(self.percentiles),
        }

    async def run(self, load: LoadSettings) -> ServeResult:
        result = await run_benchmark(
            self.endpoint,
            self.requests,
            load,
            self.tokenizer,
            self.percentiles,
            self.slos,
            self.show_progress,
        )
        result.info = self.info(load)
        return result


def prepare_target(args: argparse.Namespace) -> Target:
    """Parse and check the shared flags, find the model and tokenizer, build the dataset."""
    if getattr(args, "plot", None):
        plots.require_matplotlib()
    model, tokenizer_dir = asyncio.run(
        resolve_model(args.base_url, args.model, args.tokenizer, args.api_key)
    )
    return make_target(args, DatasetConfig.from_args(args), args.base_url, model, tokenizer_dir)


def make_target(
    args: argparse.Namespace,
    dataset: DatasetConfig,
    base_url: str,
    model: str,
    tokenizer_dir: str | None,
) -> Target:
    """`tokenizer_dir` None: the server's own tokenizer, over its /tokenize."""

    slos = parse_goodput(args.goodput)
    percentiles = parse_percentiles(args.percentiles)
    extra_body = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra_body, dict):
        raise ValueError("--extra-body must be a JSON object")
    if dataset.name == "random-ids" and args.endpoint != "/v1/completions":
        raise ValueError("--dataset-name random-ids sends token ids: --endpoint /v1/completions")
    tokenizer, tokenizer_id = _load_tokenizer(tokenizer_dir, dataset, base_url, model, args.api_key)
    print(f"generating the {dataset.name} dataset with the tokenizer of {tokenizer_id}")
    requests = generate_dataset(dataset, tokenizer)
    print(describe(requests))
    endpoint = EndpointConfig(
        base_url,
        model,
        args.endpoint,
        args.temperature,
        ignore_eos=True,
        extra_body=extra_body,
        api_key=args.api_key,
        request_timeout=args.request_timeout,
    )
    return Target(
        endpoint,
        tokenizer,
        tokenizer_id,
        requests,
        dataset,
        percentiles,
        slos,
        not args.disable_tqdm,
    )


def _load_tokenizer(
    source: str | None, dataset: DatasetConfig, base_url: str, model: str, api_key: str | None
) -> tuple[Any, str]:
    """(tokenizer, how results name it): a local directory or GGUF file, else the server's."""
    from tokenmill.models.loader import load_tokenizer

    if source is not None:
        return load_tokenizer(source), source  # a Hugging Face directory or a GGUF file
    if dataset.name == "random-ids":
        raise BenchError(
            f"no local tokenizer for model {model!r}: --dataset-name random-ids draws from the "
            "vocabulary, which /tokenize does not list; pass --tokenizer DIR or FILE.gguf"
        )
    tokenizer = ServerTokenizer.connect(base_url, model, api_key)
    return tokenizer, tokenizer.source


async def resolve_model(
    base_url: str, model: str | None, tokenizer: str | None, api_key: str | None = None
) -> tuple[str, str | None]:
    """(model name to send, local tokenizer: a directory or a GGUF file, or None: the server's
    own, over /tokenize). Without --model, the server's first model; without --tokenizer,
    --model if it is one, else the served model's root (a GGUF server's root is its file) if
    it is on this machine.
    `api_key`: the bearer token a keyed server wants on /v1/models too."""
    if model is not None and tokenizer is not None:
        return model, tokenizer
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with new_http_client(30.0, None, headers) as client:
        served = await get_served_models(client, base_url)
    if not served:
        raise BenchError(f"{base_url}/v1/models lists no model")
    entry = served[0] if model is None else next((m for m in served if m["id"] == model), {})
    model = model or entry["id"]
    for candidate in (tokenizer, model, entry.get("root")):
        if candidate and _is_tokenizer_source(Path(candidate)):
            return model, candidate
    if tokenizer is not None:
        raise BenchError(f"--tokenizer {tokenizer}: not a directory or a .gguf file")
    return model, None


def _is_tokenizer_source(path: Path) -> bool:
    """A Hugging Face directory, or a GGUF file (its tokenizer is in its metadata)."""
    return path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf")


def run_serve(args: argparse.Namespace) -> int:
    target = prepare_target(args)
    load = LoadSettings(args.request_rate, args.burstiness, args.max_concurrency, args.seed)
    print(f"benchmarking {target.endpoint.base_url}{target.endpoint.endpoint}: {load.describe()}")
    result = asyncio.run(target.run(load))
    print(format_report(result.metrics, target.slos))
    if args.save_result:
        save_json(result.to_dict(), args.save_result)
    if args.plot:
        for path in plots.plot_serve_result(result, Path(args.plot)):
            print(f"wrote {path}")
    return 0


def save_json(data: dict[str, Any], path: str | Path) -> None:
    """Compact, as vLLM writes its results (`python -m json.tool` pretty-prints one)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, separators=(",", ":"))
    print(f"wrote {path}")
