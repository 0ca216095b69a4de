"""Offline throughput: tokenmill's continuous batching against Hugging Face `generate` in
static padded batches, on the same checkpoint and the same requests, in one run; or, with
`--compare`, tokenmill against itself under other engine flags (an A/B of one setting).

    tokenmill bench throughput --skip-hf
    tokenmill bench throughput --compare auto="" torch="--linear-backend torch"

Each `--compare NAME="FLAGS"` is an engine of its own: the command's engine flags with FLAGS
on top. Every engine stays loaded; each repeat runs the same workload on each in turn (an
empty prefix cache each time), so they share the machine's noise; medians, the ratio to the
first, and whether each one's greedy tokens equal the first's (a setting that should not
change the computation, and does, shows there).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class ThroughputResult:
    name: str
    seconds: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    overhead_fraction: float | None = None  # share of step time outside the model forward


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64, help="requests in the workload")
    parser.add_argument(
        "--input-len",
        type=int,
        nargs=2,
        default=[16, 256],
        metavar=("MIN", "MAX"),
        help="prompt tokens, uniform in [MIN, MAX]",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=[16, 128],
        metavar=("MIN", "MAX"),
        help="output tokens, uniform in [MIN, MAX]",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="requests computed together: HF's static batch and tokenmill's --max-num-seqs",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each; medians reported")
    parser.add_argument(
        "--workload-seed", type=int, default=0, help="seed of the prompts and their lengths"
    )
    parser.add_argument("--skip-hf", action="store_true", help="tokenmill only")
    parser.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar='NAME="FLAGS"',
        help="tokenmill under each set of engine flags instead of HF (the first is the baseline)",
    )
    parser.add_argument("--save-result", default=None, help="write the results as JSON here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bars")


def make_workload(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_prompts):
        n = rng.randint(*input_len)
        prompts.append([rng.randrange(10, vocab) for _ in range(n)])
        output_lens.append(rng.randint(*output_len))
    return Workload(prompts, output_lens)


def run_tokenmill(llm, workload: Workload, progress: bool = False) -> tuple[float, float]:
    """Seconds for the whole workload and the fraction of step time outside the forward.
    The progress bar moves when requests finish, so it costs next to nothing."""
    seconds, overhead, _ = _timed_generate(llm, workload, progress)
    return seconds, overhead


def _timed_generate(
    llm, workload: Workload, progress: bool = False
) -> tuple[float, float, list[list[int]]]:
    """(seconds, fraction of step time outside the forward, each request's token ids)."""
    from tokenmill.sampling_params import SamplingParams

    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in workload.output_lens
    ]
    before = llm.get_stats()
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=progress)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    generated = sum(len(t) for t in tokens)
    assert generated == workload.num_output_tokens, (generated, workload.num_output_tokens)
    after = llm.get_stats()
    forward = after.forward_seconds - before.forward_seconds
    step = after.step_seconds - before.step_seconds
    return seconds, 1.0 - forward / step, tokens


def run_hf_static(
    model, workload: Workload, batch_size: int, pad_id: int, progress: bool = False
) -> float:
    """Hugging Face `generate`, batches of `batch_size` left-padded prompts; every batch runs
    until its longest output is done (the static-batching baseline)."""
    import torch
    from tqdm import tqdm

    start = time.perf_counter()
    batch_starts = range(0, len(workload.prompts), batch_size)
    for i in tqdm(batch_starts, desc="HF static batches", disable=not progress):
        prompts = workload.prompts[i : i + batch_size]
        max_new = max(workload.output_lens[i : i + batch_size])
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return time.perf_counter() - start


def run_throughput(args: argparse.Namespace, llm: Any) -> list[ThroughputResult]:
    """`llm`: the offline `LLM` to measure, made by the caller from the engine flags with
    `max_num_seqs = args.batch_size` (this package sits below the entrypoints)."""
    import torch
    from transformers import AutoModelForCausalLM

    workload = make_workload(
        args.num_prompts,
        tuple(args.input_len),
        tuple(args.output_len),
        llm.engine.vocab_size,
        args.workload_seed,
    )
    total_tokens = workload.num_output_tokens + sum(len(p) for p in workload.prompts)
    hf_model = None
    if not args.skip_hf:
        hf_model = AutoModelForCausalLM.from_pretrained(
            llm.engine.parts.model_dir, dtype=llm.engine.parts.dtype
        )
        hf_model.eval()
    pad_id = llm.get_tokenizer().pad_token_id or 0

    tokenmill_runs, overheads, hf_runs = [], [], []
    run_tokenmill(llm, make_workload(4, (8, 16), (4, 8), llm.engine.vocab_size, 1))  # warm-up
    for _ in range(args.repeats):  # interleaved, so both see the same machine noise
        seconds, overhead = run_tokenmill(llm, workload, progress=not args.disable_tqdm)
        tokenmill_runs.append(seconds)
        overheads.append(overhead)
        if hf_model is not None:
            with torch.inference_mode():
                hf_runs.append(
                    run_hf_static(
                        hf_model, workload, args.batch_size, pad_id, not args.disable_tqdm
                    )
                )

    results = [_result("tokenmill", tokenmill_runs, workload, total_tokens, overheads)]
    if hf_runs:
        results.append(_result(f"hf-static-b{args.batch_size}", hf_runs, workload, total_tokens))
    _print(results, workload, args)
    if len(results) == 2:
        ratio = results[0].output_tokens_per_s / results[1].output_tokens_per_s
        print(f"tokenmill / {results[1].name} output throughput: {ratio:.2f}x")
    _save(results, args.save_result)
    return results


def parse_compare(entries: list[str]) -> dict[str, str]:
    """`NAME="FLAGS"` entries -> {name: flags}, in order; ValueError names a bad one."""
    configs: dict[str, str] = {}
    for entry in entries:
        name, sep, flags = entry.partition("=")
        if not sep or not name.strip():
            raise ValueError(f'--compare {entry!r}: expected NAME="ENGINE FLAGS"')
        if name.strip() in configs:
            raise ValueError(f"--compare: the name {name.strip()!r} is given twice")
        configs[name.strip()] = flags
    return configs


def run_compare(args: argparse.Namespace, llms: dict[str, Any]) -> list[ThroughputResult]:
    """The same workload on each of `llms` (name -> offline `LLM`, the first the baseline),
    interleaved over `args.repeats` rounds."""
    vocab = min(llm.engine.vocab_size for llm in llms.values())
    workload = make_workload(
        args.num_prompts, tuple(args.input_len), tuple(args.output_len), vocab, args.workload_seed
    )
    total_tokens = workload.num_output_tokens + sum(len(p) for p in workload.prompts)
    warm_up = make_workload(4, (8, 16), (4, 8), vocab, 1)
    runs: dict[str, list[float]] = {name: [] for name in llms}
    overheads: dict[str, list[float]] = {name: [] for name in llms}
    tokens: dict[str, list[list[int]]] = {}
    for llm in llms.values():
        _timed_generate(llm, warm_up)
    for _ in range(args.repeats):
        for name, llm in llms.items():
            llm.reset_prefix_cache()  # every run computes every prompt
            seconds, overhead, tokens[name] = _timed_generate(llm, workload)
            runs[name].append(seconds)
            overheads[name].append(overhead)
    results = [_result(n, runs[n], workload, total_tokens, overheads[n]) for n in llms]
    _print(results, workload, args)
    baseline = results[0]
    for result in results[1:]:
        ratio = result.output_tokens_per_s / baseline.output_tokens_per_s
        same = "the same" if tokens[result.name] == tokens[baseline.name] else "different"
        print(f"{result.name} / {baseline.name}: {ratio:.2f}x output throughput, {same} tokens")
    _save(results, args.save_result)
    return results


def _save(results: list[ThroughputResult], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)


def _result(
    name: str,
    runs: list[float],
    workload: Workload,
    total_tokens: int,
    overheads: list[float] | None = None,
) -> ThroughputResult:
    seconds = statistics.median(runs)
    return ThroughputResult(
        name=name,
        seconds=seconds,
        output_tokens_per_s=workload.num_output_tokens / seconds,
        total_tokens_per_s=total_tokens / seconds,
        overhead_fraction=statistics.median(overheads) if overheads else None,
    )


def _print(results: list[ThroughputResult], workload: Workload, args: argparse.Namespace) -> None:
    print(
        f"{len(workload.prompts)} requests, input {args.input_len[0]}-{args.input_len[1]}, "
        f"output {args.output_len[0]}-{args.output_len[1]} tokens "
        f"({workload.num_output_tokens} output tokens); median of {args.repeats} runs"
    )
    print(f"{'engine':<20}{'seconds':>10}{'out tok/s':>12}{'total tok/s':>13}{'overhead':>10}")
    for r in results:
        overhead = "" if r.overhead_fraction is None else f"{r.overhead_fraction:.1%}"
        print(
            f"{r.name:<20}{r.seconds:>10.2f}{r.output_tokens_per_s:>12.1f}"
            f"{r.total_tokens_per_s:>13.1f}{overhead:>10}"
        )
