"""Speculative decoding benchmark, offline, every configuration side by side in one run.

    python -m benchmarks.spec_decode [--model PATH] [--draft-model PATH] [--eagle-model PATH]
        [--medusa-model PATH] [--methods ngram,suffix,draft,eagle,medusa] [--repeats 3]

`--eagle-model` given again adds another EAGLE configuration ("eagle#2", ...), to compare
heads side by side in one run.

With no model: the demo target, its draft and its EAGLE / Medusa heads (tokenmill.demo), on
held-out demo prompts.
1. Batch-1 decode tokens/s on prompts whose answer echoes the input (copy a passage) and on
   the mix of all demo tasks: no speculation vs n-gram prompt lookup vs suffix decoding vs
   the draft model vs EAGLE vs Medusa.
2. Throughput at concurrency 1, 8, 32, 64 (max_num_seqs = concurrency, 2x that many requests)
   on echo prompts: speculation off, then each method with a fixed k and with the adaptive
   policy.
Medians of interleaved repeats; greedy, so every configuration generates the same tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

from demo_training.acceptance import STORY_PROMPTS
from tokenmill import LLM, SamplingParams
from tokenmill.demo.eval import heldout
from tokenmill.demo.tasks import CHECKABLE_TASKS
from tokenmill.metrics.stats import SpecDecodeStats
from tokenmill.outputs import RequestOutput


def chat_prompts(llm: LLM, tasks: list[str], count: int) -> list[str]:
    """`count` held-out demo prompts of `tasks` (round robin), rendered by the chat template."""
    per_task = -(-count // len(tasks))
    examples = heldout(per_task, tasks)
    by_task = [[e for e in examples if e.task == t] for t in tasks]
    chosen = [by_task[i % len(tasks)][i // len(tasks)] for i in range(count)]
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.apply_chat_template(
            e.messages(), tools=list(e.tools) or None, tokenize=False, add_generation_prompt=True
        )
        for e in chosen
    ]


def task_prompts(llm: LLM, task: str, count: int) -> list[str]:
    """Held-out chat prompts of one demo task; "story": the plain-text story openings."""
    return list(STORY_PROMPTS) if task == "story" else chat_prompts(llm, [task], count)


def generate_greedy(llm: LLM, prompts: list[str], max_tokens: int) -> list[RequestOutput]:
    """Replies end where the model ends them (after the copy), as a client would see. Chat
    prompts carry their special tokens in the template; plain text (stories) gets BOS."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    plain = prompts[0] in STORY_PROMPTS
    return llm.generate(prompts, params, use_tqdm=False, add_special_tokens=plain)


def timed(llm: LLM, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    """Seconds and generated tokens of `generate_greedy`."""
    start = time.perf_counter()
    outputs = generate_greedy(llm, prompts, max_tokens)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outputs)


def median_tokens_per_s(
    engines: dict[str, LLM], prompts_for, max_tokens: int, repeats: int
) -> dict[str, float]:
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, llm in engines.items():
            llm.reset_prefix_cache()
            seconds, tokens = timed(llm, prompts_for(llm), max_tokens)
            runs[name].append(tokens / seconds)
    return {name: statistics.median(r) for name, r in runs.items()}


class DraftCounts(NamedTuple):
    drafted: int  # draft tokens
    accepted: int  # of them accepted
    steps: int  # verification steps with drafts


def drafts_since(llm: LLM, before: SpecDecodeStats | None) -> DraftCounts | None:
    """The engine's draft counters since the `before` snapshot; None without speculation."""
    now = llm.get_stats().scheduler.spec_decode
    if now is None or before is None:
        return None
    return DraftCounts(
        now.num_draft_tokens - before.num_draft_tokens,
        now.num_accepted_tokens - before.num_accepted_tokens,
        now.num_drafts - before.num_drafts,
    )


def acceptance(llm: LLM, before: SpecDecodeStats | None) -> str:
    """Acceptance since the `before` snapshot of the engine's counters."""
    counts = drafts_since(llm, before)
    if counts is None:
        return ""
    if not counts.drafted:
        return "  (no drafts)"
    share, mean_length = counts.accepted / counts.drafted, 1 + counts.accepted / counts.steps
    return f"  (acceptance {share:.0%}, mean acceptance length {mean_length:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the demo target")
    parser.add_argument("--draft-model", default=None, help="default: the demo target's draft")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument(
        "--eagle-model",
        action="append",
        default=None,
        help="default: the demo target's; repeat it to compare heads (eagle, eagle#2, ...)",
    )
    parser.add_argument("--medusa-model", default=None, help="default: the demo target's")
    parser.add_argument("--methods", default="ngram,draft,eagle,medusa")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument(
        "--tasks",
        default=None,
        help="batch 1 per demo task instead of echo / all tasks, e.g. copy,story,lookup",
    )
    args = parser.parse_args()
    methods = {
        "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
        # The request's own trie only: repeats of the same prompts would otherwise draft
        # from the cached outputs of the previous repeat.
        "suffix": {
            "method": "suffix",
            "num_speculative_tokens": args.k,
            "suffix_decoding_max_cached_requests": 0,
        },
    }
    # name -> (method, model); a None model is the demo target's default.
    with_models = [("draft", "draft_model", args.draft_model)]
    for i, model in enumerate(args.eagle_model or [None]):
        with_models.append(("eagle" if i == 0 else f"eagle#{i + 1}", "eagle", model))
    with_models.append(("medusa", "medusa", args.medusa_model))
    for name, method, model in with_models:
        if model or args.model is None:
            methods[name] = {"method": method, "model": model, "num_speculative_tokens": args.k}
            if model:
                print(f"{name}: {model}")
    chosen = args.methods.split(",")
    methods = {name: spec for name, spec in methods.items() if name.split("#")[0] in chosen}

    def engine(max_num_seqs: int, spec: dict | None = None) -> LLM:
        return LLM(model=args.model, max_num_seqs=max_num_seqs, speculative_config=spec)

    echo, mix = ["copy"], list(CHECKABLE_TASKS)
    batch1 = {"off": engine(1)}
    for name, spec in methods.items():
        batch1[f"{name} fixed k={args.k}"] = engine(1, {**spec, "adaptive": False})
        batch1[f"{name} adaptive"] = engine(1, spec)
    groups = [("echo (copy) prompts", echo), ("all demo tasks", mix)]
    if args.tasks:
        groups = [(f"task {t}", [t]) for t in args.tasks.split(",")]
    for label, tasks in groups:
        print(f"## batch 1, {label}: tokens/s")
        before = {name: llm.get_stats().scheduler.spec_decode for name, llm in batch1.items()}

        def prompts_for(llm: LLM, t: list[str] = tasks) -> list[str]:
            if len(t) == 1:
                return task_prompts(llm, t[0], 8)
            return chat_prompts(llm, t, max(8, 2 * len(t)))

        rates = median_tokens_per_s(batch1, prompts_for, args.max_tokens, args.repeats)
        base = rates["off"]
        for name, rate in rates.items():
            accepted = acceptance(batch1[name], before[name])
            print(f"  {name:<22} {rate:8.1f} tok/s  {rate / base:5.2f}x{accepted}")
    del batch1

    print("\n## throughput by concurrency, echo prompts, tokens/s (ratio to off)")
    names = [f"{m} {mode}" for m in methods for mode in ("fixed", "adaptive")]
    print(f"  {'concurrency':>11} {'off':>8} " + " ".join(f"{n:>16}" for n in names))
    for concurrency in map(int, filter(None, args.concurrency.split(","))):
        engines = {"off": engine(concurrency)}
        for name, spec in methods.items():
            engines[f"{name} fixed"] = engine(concurrency, {**spec, "adaptive": False})
            engines[f"{name} adaptive"] = engine(concurrency, spec)
        count = max(2 * concurrency, 4)
        rates = median_tokens_per_s(
            engines, lambda llm, n=count: chat_prompts(llm, echo, n), args.max_tokens,
            args.repeats,
        )  # fmt: skip
        off = rates["off"]
        cells = " ".join(f"{rates[n]:7.1f} ({rates[n] / off:.2f}x)" for n in names)
        print(f"  {concurrency:>11} {off:8.1f} {cells}")
        del engines


if __name__ == "__main__":
    main()
