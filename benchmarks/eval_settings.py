"""Greedy accuracy of the demo target under engine settings that must not change answers.

    python -m benchmarks.eval_settings [--num-per-task 100]

Runs `tokenmill eval`'s held-out set through the offline engine once per setting and prints
correct answers per task side by side. Greedy decoding is deterministic, so a setting that
changes a count changed the computation: FP8 KV is expected to move a few answers (it rounds
the cache); everything else must match the baseline.
"""

from __future__ import annotations

import argparse
import gc
import time

from tokenmill import LLM
from tokenmill.demo.eval import heldout, offline_replies, replies_to, score
from tokenmill.demo.tasks import CHECKABLE_TASKS

SETTINGS: dict[str, dict] = {
    "baseline": {},
    "budget 64 (chunks)": {"max_num_batched_tokens": 64},
    "no prefix cache": {"enable_prefix_caching": False},
    "96 blocks (preempt)": {"num_kv_blocks": 96},
    "swap preemption": {"num_kv_blocks": 96, "preemption_mode": "swap"},
    "ngram k=4": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}},
    "draft k=4": {"speculative_config": {"method": "draft_model", "num_speculative_tokens": 4}},
    "fp8 kv": {"kv_cache_dtype": "fp8"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-per-task", type=int, default=100)
    args = parser.parse_args()
    examples = heldout(args.num_per_task)
    columns: dict[str, dict[str, int]] = {}
    baseline: list[str] | None = None
    for name, settings in SETTINGS.items():
        llm = LLM(dtype="float32", **settings)
        start = time.perf_counter()
        replies = replies_to(examples, offline_replies(llm))
        seconds = time.perf_counter() - start
        report = score(examples, replies)
        baseline = baseline or replies
        stats = llm.get_stats().scheduler
        columns[name] = {t: s.num_correct for t, s in report.scores.items()}
        columns[name]["(preemptions)"] = stats.num_preemptions
        columns[name]["(replies unlike baseline)"] = sum(a != b for a, b in zip(replies, baseline))
        print(f"{name}: overall {report.overall:.3f} in {seconds:.0f} s", flush=True)
        del llm
        gc.collect()
    rows = [*CHECKABLE_TASKS, "(preemptions)", "(replies unlike baseline)"]
    print(f"\ncorrect of {args.num_per_task} per task")
    print("| task | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for row in rows:
        print(f"| {row} | " + " | ".join(str(c[row]) for c in columns.values()) + " |")


if __name__ == "__main__":
    main()
