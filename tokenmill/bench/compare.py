"""`tokenmill bench compare`: one workload against several server configurations, in turn.

Each configuration is either started here (`tokenmill serve` with its flags, on a free
loopback port, stopped before the next starts so they never compete for the machine) or
given as the URL of a running server. Every configuration sees the same requests at the same
arrival times; only the server differs. A configuration the server refuses (an unknown flag,
a failed start) is reported as unavailable and the others still run.

Presets (`presets.py`) name the comparisons the engine's claims rest on.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import shlex
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench import plots
from tokenmill.bench.client import BenchError
from tokenmill.bench.datasets import DatasetConfig, add_dataset_args, dataset_overrides
from tokenmill.bench.machine import machine_info
from tokenmill.bench.metrics import compute_metrics, parse_percentiles
from tokenmill.bench.plots import format_value
from tokenmill.bench.presets import PRESETS, THROUGHPUT, Headline, Preset, ServerConfig
from tokenmill.bench.report import ServeResult, metrics_to_dict
from tokenmill.bench.serve import (
    LoadSettings,
    Target,
    add_measure_args,
    add_request_args,
    make_target,
    resolve_model,
    save_json,
)
from tokenmill.bench.server_process import ServerProcess, ServerStartError

COMPARE_PERCENTILES = (50.0, 90.0, 95.0, 99.0)  # the headlines use these


@dataclass
class ConfigOutcome:
    """Every run of one configuration; its figures are the medians over the runs."""

    config: ServerConfig
    results: list[ServeResult] = field(default_factory=list)
    unavailable: str | None = None  # why, when it could not be measured
    run_headlines: list[dict[str, float]] = field(default_factory=list)

    @property
    def measured(self) -> bool:
        return bool(self.results)

    @property
    def summary(self) -> dict[str, Any]:
        return _medians([metrics_to_dict(r.metrics) for r in self.results])

    @property
    def headlines(self) -> dict[str, float]:
        return _medians(self.run_headlines)


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key, the median over runs of its numeric values (the value itself for one run)."""
    out: dict[str, Any] = {}
    for key in runs[0] if runs else ():
        values = [run[key] for run in runs if isinstance(run.get(key), int | float)]
        out[key] = statistics.median(values) if values else runs[0][key]
    return out


# ---- running -------------------------------------------------------------------------------


def run_compare(
    configs: list[ServerConfig],
    headlines: tuple[Headline, ...],
    make_config_target: Any,
    load: LoadSettings,
    common_server_args: list[str],
    out_dir: Path,
    start_timeout: float,
    repeats: int = 1,
) -> list[ConfigOutcome]:
    """Measure each configuration `repeats` times in interleaved rounds (A B A B ...), so slow
    drifts of a shared machine hit every configuration alike. A server started here is
    started afresh for each run (cold caches every time) and stopped before the next starts.
    `make_config_target(base_url)` -> Target."""
    outcomes = [ConfigOutcome(config) for config in configs]
    for round_index in range(repeats):
        for outcome in outcomes:
            if outcome.unavailable is not None:
                continue
            config = outcome.config
            print(f"=== {config.name} (run {round_index + 1} of {repeats}): "
                  f"{_describe_config(config, common_server_args)}")  # fmt: skip
            try:
                result = _measure_config(
                    config, make_config_target, load, common_server_args, out_dir, start_timeout
                )
            except (ServerStartError, BenchError) as e:
                outcome.unavailable = _reason(str(e))
                print(f"{config.name} is unavailable: {outcome.unavailable}")
                continue
            outcome.results.append(result)
            outcome.run_headlines.append(headline_values(result, headlines))
    return outcomes


def _measure_config(
    config: ServerConfig,
    make_config_target: Any,
    load: LoadSettings,
    common_server_args: list[str],
    out_dir: Path,
    start_timeout: float,
) -> ServeResult:
    if config.url is not None:
        return _measure(make_config_target(config.url), load)
    server_args = [*common_server_args, *config.server_args]
    log = out_dir / f"server-{config.name}.log"
    with ServerProcess(server_args, log, start_timeout) as server:
        return _measure(make_config_target(server.base_url), load)


def _measure(target: Target, load: LoadSettings) -> ServeResult:
    return asyncio.run(target.run(load))


def _describe_config(config: ServerConfig, common: list[str]) -> str:
    if config.url is not None:
        return f"running server at {config.url}"
    return "tokenmill serve " + shlex.join([*common, *config.server_args])


def _reason(message: str) -> str:
    """The telling part of a failure: argparse's `error:` line when there is one."""
    for part in message.split(" | "):
        if "error:" in part:
            return part.strip()
    return message[:300]


def headline_values(result: ServeResult, headlines: tuple[Headline, ...]) -> dict[str, float]:
    values = {}
    for headline in headlines:
        records = result.records
        if headline.category is not None:
            records = [r for r in records if r.category == headline.category]
        percentiles = tuple(result.info.get("percentiles") or (50.0, 95.0, 99.0))
        metrics = compute_metrics(records, result.metrics.duration, percentiles)
        values[headline.label] = metrics_to_dict(metrics)[headline.key]
    return values


# ---- reporting -----------------------------------------------------------------------------

_COLUMNS = (
    ("req/s", "request_throughput"),
    ("out tok/s", "output_throughput"),
    ("goodput", "request_goodput"),
    ("TTFT mean", "mean_ttft_ms"),
    ("TTFT p95", "p95_ttft_ms"),
    ("TPOT mean", "mean_tpot_ms"),
    ("TPOT p95", "p95_tpot_ms"),
    ("ITL p99", "p99_itl_ms"),
)
_COLUMN_KEYS = {key for _, key in _COLUMNS}


def format_table(
    outcomes: list[ConfigOutcome], headlines: tuple[Headline, ...], markdown: bool = False
) -> str:
    """All configurations side by side (latencies in ms), with the preset's headline figures
    that the standard columns lack; unavailable configurations say why."""
    extra_headlines = [h for h in headlines if h.category or h.key not in _COLUMN_KEYS]
    header = ["config", *(c for c, _ in _COLUMNS), *(h.label for h in extra_headlines)]
    rows = []
    for o in outcomes:
        if not o.measured:
            rows.append([o.config.name, f"unavailable: {o.unavailable}"])
            continue
        s = o.summary
        cells = [_fmt(s.get(key)) for _, key in _COLUMNS]
        extra = [_fmt(o.headlines.get(h.label)) for h in extra_headlines]
        rows.append([o.config.name, *cells, *extra])
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(header[i]), 9) for i in range(len(header))]
    widths[0] = max([len(header[0]), *(len(r[0]) for r in rows)])
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    for row in rows:
        if len(row) == 2:
            lines.append(f"{row[0].rjust(widths[0])}  {row[1]}")
        else:
            lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "-" if value is None else format_value(value)


def format_ratios(outcomes: list[ConfigOutcome], headlines: tuple[Headline, ...]) -> str:
    """Each configuration's headline figures relative to the first measured one."""
    measured = [o for o in outcomes if o.measured]
    if len(measured) < 2:
        return ""
    base = measured[0]
    lines = []
    for o in measured[1:]:
        parts = []
        for h in headlines:
            a, b = o.headlines.get(h.label), base.headlines.get(h.label)
            if a is not None and b:
                parts.append(f"{h.label} {a / b:.2f}x")
        lines.append(f"{o.config.name} / {base.config.name}: " + ", ".join(parts))
    return "\n".join(lines)


def plot_outcomes(
    outcomes: list[ConfigOutcome], headlines: tuple[Headline, ...], path: Path, title: str
) -> Path:
    metrics = {
        f"{h.label}\n({'higher' if h.higher_is_better else 'lower'} is better)": [
            o.headlines.get(h.label) for o in outcomes
        ]
        for h in headlines
    }
    names = [o.config.name for o in outcomes]
    return plots.plot_compare(names, metrics, path, title)


# ---- command line --------------------------------------------------------------------------


def add_compare_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("configurations")
    group.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="a ready-made comparison"
    )
    group.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=SERVE_ARGS",
        help="a server to start: name and `tokenmill serve` flags (repeatable)",
    )
    group.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="a running server to measure (repeatable)",
    )
    group.add_argument("--server-args", default="", help="flags for every started server")
    group.add_argument(
        "--model",
        default=None,
        help="model directory for started servers "
        "(default: the built-in model); also the tokenizer",
    )
    group.add_argument("--tokenizer", default=None, help="tokenizer directory")
    group.add_argument(
        "--server-start-timeout",
        type=float,
        default=300.0,
        help="seconds a server may take to start",
    )
    group.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per configuration, interleaved; the report shows medians (use 3+ on a "
        "shared machine)",
    )
    group.add_argument(
        "--output-dir",
        default=None,
        help="results, plot, table and server logs (default: bench-compare-NAME)",
    )
    load = parser.add_argument_group("load (default: the preset's)")
    load.add_argument(
        "--request-rate", type=float, default=None, help="requests per second (Poisson)"
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)"
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    add_request_args(parser)
    add_measure_args(parser)
    add_dataset_args(parser, with_defaults=False)


def _parse_named(items: list[str], flag: str) -> list[tuple[str, str]]:
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{flag} takes NAME=VALUE, got {item!r}")
        pairs.append((name, value))
    return pairs


def configs_from_args(args: argparse.Namespace, preset: Preset | None) -> list[ServerConfig]:
    configs = list(preset.configs) if preset else []
    configs += [
        ServerConfig(n, tuple(shlex.split(v))) for n, v in _parse_named(args.config, "--config")
    ]
    configs += [ServerConfig(n, url=v) for n, v in _parse_named(args.url, "--url")]
    if not configs:
        raise ValueError("nothing to compare: give --preset, --config or --url")
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"configuration names must differ, got {names}")
    return configs


def _tokenizer_dir(args: argparse.Namespace, configs: list[ServerConfig]) -> str:
    if args.tokenizer or args.model:
        return args.tokenizer or args.model
    if all(c.url is None for c in configs):
        from tokenmill.demo import demo_model_path

        return str(demo_model_path("target"))  # what `tokenmill serve` without --model serves
    url = next(c.url for c in configs if c.url is not None)
    return asyncio.run(resolve_model(url, None, None))[1]


def _load_settings(args: argparse.Namespace, preset: Preset | None) -> LoadSettings:
    """The flags' load where given, else the preset's, else everything at once."""
    defaults = preset.load if preset else {}
    rate = args.request_rate if args.request_rate is not None else defaults.get("request_rate")
    return LoadSettings(
        rate if rate is not None else math.inf,
        args.burstiness,
        args.max_concurrency or defaults.get("max_concurrency"),
        args.seed,
    )


def run_compare_cli(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    preset = PRESETS[args.preset] if args.preset else None
    configs = configs_from_args(args, preset)
    dataset = DatasetConfig(**{**(preset.dataset if preset else {}), **dataset_overrides(args)})
    load = _load_settings(args, preset)
    common = [*(preset.server_args if preset else ()), *shlex.split(args.server_args)]
    if args.model:
        common += ["--model", args.model]
    percentiles = {*parse_percentiles(args.percentiles), *COMPARE_PERCENTILES}
    args.percentiles = ",".join(f"{p:g}" for p in sorted(percentiles))
    name = args.preset or "custom"
    out_dir = Path(args.output_dir or f"bench-compare-{name}")
    tokenizer_dir = _tokenizer_dir(args, configs)

    base = make_target(args, dataset, "", "", tokenizer_dir)  # each server fills in its own

    def target_for(base_url: str) -> Target:
        model = asyncio.run(resolve_model(base_url, None, tokenizer_dir))[0]
        endpoint = dataclasses.replace(base.endpoint, base_url=base_url.rstrip("/"), model=model)
        return dataclasses.replace(base, endpoint=endpoint)

    print(f"comparing {len(configs)} configurations: {load.describe()}")
    headlines = preset.headlines if preset else (THROUGHPUT,)
    outcomes = run_compare(
        configs, headlines, target_for, load, common, out_dir, args.server_start_timeout,
        args.repeats,
    )  # fmt: skip
    _write_outputs(name, preset, outcomes, headlines, load, common, out_dir, args.repeats)
    return 0 if any(o.measured for o in outcomes) else 1


def _write_outputs(
    name: str,
    preset: Preset | None,
    outcomes: list[ConfigOutcome],
    headlines: tuple[Headline, ...],
    load: LoadSettings,
    common: list[str],
    out_dir: Path,
    repeats: int,
) -> None:
    table = format_table(outcomes, headlines)
    ratios = format_ratios(outcomes, headlines)
    print(f"\n{name}: {preset.description if preset else 'custom comparison'}")
    runs = f"median of {repeats} runs" if repeats > 1 else "one run"
    print(f"latencies in ms, {runs}\n{table}")
    if ratios:
        print(ratios)
    info = machine_info()
    save_json(
        {
            "preset": name,
            "machine": info,
            "repeats": repeats,
            "common_server_args": common,
            "configs": [
                {
                    "name": o.config.name,
                    "server_args": list(o.config.server_args),
                    "url": o.config.url,
                    "unavailable": o.unavailable,
                    "headlines": o.headlines,  # medians over the runs
                    "summary": o.summary,  # medians over the runs
                    "runs": [r.to_dict() for r in o.results],
                }
                for o in outcomes
            ],
        },
        out_dir / "compare.json",
    )
    markdown = f"{format_table(outcomes, headlines, markdown=True)}\n\n{ratios}\n"
    (out_dir / "compare.md").write_text(markdown)
    title = f"{name}: {load.describe()}, {runs} ({info['cpu']}, {info['num_cpus']} CPUs)"
    if plots.matplotlib_available():
        print(f"wrote {plot_outcomes(outcomes, headlines, out_dir / 'compare.png', title)}")
    else:
        print(f"no compare.png: {plots.MISSING_MATPLOTLIB}")
