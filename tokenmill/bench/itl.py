"""The ITL-under-prefill scenario, offline (`LLMEngine` steps timed in-process) and over HTTP
(itl_serving.py), and its report: `tokenmill bench itl` (itl_command.py says what it measures)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenmill.bench.itl_serving import (
    Scenario,
    llama_server,
    served_run,
    tokenmill_server,
)
from tokenmill.bench.itl_stats import TABLE_HEADER, Run, disaggregation_check, goal_check, report
from tokenmill.bench.llamacpp import gguf_file, source_tree, whole_character_bias
from tokenmill.bench.random_model import PRESETS, make_random_model
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.openmp import forget_openmp_wait_policy
from tokenmill.sampling_params import SamplingParams

MODEL_NAME = "bench-smollm2-135m-shaped-8k-v2"  # bump the version when changing the recipe
FIXED_BUDGETS: dict[str, dict[str, Any]] = {
    "2048 chunked": {"max_num_batched_tokens": 2048},
    "512 chunked": {"max_num_batched_tokens": 512},
    "256 chunked": {"max_num_batched_tokens": 256},
    "8192 unchunked": {"max_num_batched_tokens": 8192, "enable_chunked_prefill": False},
}
TARGET_FACTORS = (1.5, 2.0)
SERVED_TARGET_FACTORS = (2.0,)
# Issue 32: a prefill instance and a decode instance, each on half the cores (one each on 2).
DISAGGREGATED = "tokenmill serve --disaggregate (half the cores each)"


def disaggregated_label(duty: float) -> str:
    return DISAGGREGATED if duty == 1.0 else f"{DISAGGREGATED}, recv_duty_cycle {duty:g}"


def smollm2_shaped_model() -> Path:
    """SmolLM2-135M's shape (`tokenmill bench make-model --preset smollm`) with an 8192-token
    context, built once into the cache directory (the benchmark feeds token ids)."""
    return make_random_model(
        MODEL_NAME, {**PRESETS["smollm"].shape, "max_position_embeddings": 8192}
    )


def run_once(
    model: Path,
    engine_kwargs: dict[str, Any],
    args: argparse.Namespace,
    target_factor: float | None = None,
) -> Run:
    """One run of the scenario. With `target_factor`, the ITL target is that factor times the
    steady step measured in this engine just before the long prompt arrives (a shared
    machine's step time moves 20-30% from one engine to the next, so a target taken from
    another run's steady step may leave the decodes alone over it)."""
    if target_factor is not None:  # provisional, until this engine's steady step is known
        engine_kwargs = {**engine_kwargs, "itl_target_ms": target_factor * 150.0}
    engine = LLMEngine(
        EngineConfig(
            model=str(model), dtype="float32", max_model_len=args.max_model_len, **engine_kwargs
        )
    )
    rng = random.Random(0)
    vocab = engine.vocab_size
    for i in range(args.streams):
        prompt = [rng.randrange(3, vocab) for _ in range(args.stream_prompt)]
        # Decoding through the whole run (the default max_tokens, 16, ended the streams during
        # the steady steps: the long prompt then arrived into an idle engine).
        params = SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=args.max_model_len - args.stream_prompt
        )
        engine.add_request(f"stream-{i}", prompt, params)
    decoding: set[str] = set()
    while len(decoding) < args.streams:  # until every stream decodes (under a target the
        decoding.update(o.request_id for o in engine.step())  # prompts take several steps)
    steady = [timed_step(engine)[0] for _ in range(args.steady_steps)]
    if target_factor is not None:
        engine.set_itl_target_ms(target_factor * 1000 * statistics.median(steady))

    long_prompt = [rng.randrange(3, vocab) for _ in range(args.long_prompt)]
    before = engine.get_stats()
    arrival = time.perf_counter()
    engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=1))
    admission, ttft = [], None
    while ttft is None:
        seconds, outputs = timed_step(engine)
        admission.append(seconds)
        if any(o.request_id == "long" for o in outputs):
            ttft = time.perf_counter() - arrival
    streams = [r for r in engine.running_request_ids() if r.startswith("stream-")]
    assert len(streams) == args.streams, "a stream stopped decoding during the run"
    after = engine.get_stats()
    tokens = (after.num_prompt_tokens - before.num_prompt_tokens) + (
        after.num_generation_tokens - before.num_generation_tokens
    )
    itl = after.scheduler.itl_target
    return Run(
        steady=statistics.median(steady),
        admission_itls=admission,
        ttft=ttft,
        throughput=tokens / ttft,
        steps_over_target=None if itl is None else itl.num_steps_over_target,
        target=None if itl is None else itl.itl_target,
        num_steps=len(admission),
    )


def timed_step(engine: LLMEngine) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = engine.step()
    return time.perf_counter() - start, outputs


def measure(
    first_label: str,
    first: Callable[[], Run],
    rest: Callable[[Run], dict[str, Callable[[], Run]]],
    repeats: int,
    calibration_runs: int = 1,
) -> dict[str, list[Run]]:
    """Run `first` `calibration_runs` times, then the configurations `rest` derives from the
    run with the lowest steady ITL (the targets follow it: noise only ever slows a step, so
    the lowest is the closest to the engine's own), `repeats` times, interleaved; the runs
    of each configuration (the calibration runs count as `first`'s)."""
    calibration = [first() for _ in range(calibration_runs)]
    for baseline in calibration:
        print(f"calibration: {report(first_label, [baseline])}", flush=True)
    configs = {first_label: first, **rest(min(calibration, key=lambda r: r.steady))}
    runs: dict[str, list[Run]] = {label: [] for label in configs}
    runs[first_label] += calibration
    for repeat in range(repeats):
        for label, run in configs.items():
            if label == first_label and repeat < calibration_runs:
                continue
            runs[label].append(run())
            print(f"repeat {repeat}: {report(label, runs[label][-1:])}", flush=True)
    return runs


def offline_runs(model: Path, args: argparse.Namespace) -> dict[str, list[Run]]:
    def configuration(kwargs: dict[str, Any], factor: float | None = None) -> Callable[[], Run]:
        return lambda: run_once(model, kwargs, args, factor)

    def rest(baseline: Run) -> dict[str, Callable[[], Run]]:
        configs = {label: configuration(kwargs) for label, kwargs in FIXED_BUDGETS.items()}
        del configs["2048 chunked"]
        if args.only_targets:
            configs = {}
        for factor in TARGET_FACTORS:
            configs[f"itl target {factor}x its steady step"] = configuration({}, factor)
        return configs

    return measure("2048 chunked", configuration(FIXED_BUDGETS["2048 chunked"]), rest, args.repeats)


def served_runs(model: Path, args: argparse.Namespace) -> dict[str, list[Run]]:
    forget_openmp_wait_policy()  # llama-server inherits this process's environment
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    scenario = Scenario(
        streams=args.streams,
        stream_prompt=args.stream_prompt,
        stream_max_tokens=args.stream_max_tokens,
        long_prompt=args.long_prompt,
        steady_steps=args.steady_steps,
        vocab_size=vocab_size,
    )
    logs = Path(tempfile.mkdtemp(prefix="itl-serving-"))
    print(f"server logs: {logs}", flush=True)
    import torch  # here: loaded before tokenmill, it would miss tokenmill's OpenMP policy

    threads = torch.get_num_threads()  # what `tokenmill serve` uses; llama-server gets as many

    def tokenmill(label: str, flags: list[str]) -> Callable[[], Run]:
        log = logs / (label.replace(" ", "_").replace("/", "") + ".log")
        return lambda: served_run(tokenmill_server(model, args.max_model_len, flags, log), scenario)

    llama_rows: dict[str, Callable[[], Run]] = {}
    if args.llama_cpp_bin is None:
        print("llama-server rows skipped: no --llama-cpp-bin DIR given", flush=True)
    else:
        gguf = gguf_file(model, source_tree(args.llama_cpp_bin), "float32")
        bias = {"logit_bias": whole_character_bias(model)}  # one chunk per token
        small = str(args.llama_small_batch)
        for name, flags in {
            "default": [],
            f"-ub {small}": ["--ubatch-size", small],
            f"-b {small} -ub {small}": ["--batch-size", small, "--ubatch-size", small],
        }.items():
            label = f"llama-server {name}, {threads} threads"
            log = logs / (f"llama-server {name}".replace(" ", "_") + ".log")
            llama_rows[label] = lambda flags=flags, log=log: served_run(
                llama_server(args.llama_cpp_bin, gguf, scenario, threads, flags, log),
                scenario,
                bias,
            )

    def rest(baseline: Run) -> dict[str, Callable[[], Run]]:
        configs = {}
        for factor in SERVED_TARGET_FACTORS:
            target_ms = factor * 1000 * baseline.steady
            label = f"tokenmill serve, itl target {factor}x = {target_ms:.0f} ms"
            configs[label] = tokenmill(label, ["--itl-target-ms", f"{target_ms:.1f}"])
        for duty in [] if args.no_disaggregate else args.recv_duty_cycles:
            label = disaggregated_label(duty)
            extra = {
                "kv_connector": "P2pConnector",
                "kv_connector_extra_config": {"recv_duty_cycle": duty},
            }
            flags = ["--disaggregate", "--kv-transfer-config", json.dumps(extra)]
            configs[label] = tokenmill(label, flags)
        return {**configs, **llama_rows}

    if args.llama_only:
        first, *others = llama_rows
        return measure(first, llama_rows[first], lambda _: {o: llama_rows[o] for o in others},
                       args.repeats)  # fmt: skip
    first = "tokenmill serve, default budget (2048)"
    # Two servers' steady ITL for the target: one noisy run (88 ms against 70-73 ms) once gave
    # the chunked row a target of 2.4x its own steady step instead of 2x.
    return measure(first, tokenmill(first, []), rest, args.repeats, calibration_runs=2)


def run_itl(args: argparse.Namespace) -> int:
    model = args.model or smollm2_shaped_model()
    runs = served_runs(model, args) if args.server else offline_runs(model, args)
    print("\n" + TABLE_HEADER)
    for label, label_runs in runs.items():
        print(report(label, label_runs))
    baseline_label = next(iter(runs))
    print(f"\nIssue 19's goal, against {baseline_label}:")
    for label, label_runs in runs.items():
        if "target" in label:
            print(goal_check(label, runs[baseline_label], label_runs))
    chunked = [label for label in runs if "target" in label]
    disaggregated = [label for label in runs if label.startswith(DISAGGREGATED)]
    if disaggregated and chunked:
        print(f"\nIssue 32's goal, against {chunked[0]}:")
        for label in disaggregated:
            print(disaggregation_check(label, runs[chunked[0]], runs[label]))
    return 0
