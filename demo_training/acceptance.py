"""Estimated draft acceptance under greedy speculative decoding: the numbers in the docs.

Under greedy verification a proposed token is accepted iff it equals the target's argmax, and
after every step the sequence so far is exactly the target's greedy output. So the draft's
acceptance can be measured without a speculative engine: take the target's greedy replies to
held-out prompts, run both models over prompt + reply (teacher forcing), and compare their
argmax at each reply position. From the match pattern we also replay greedy speculation with
k proposals per step to get the tokens produced per target forward pass.

Heads on the target (`--method eagle` or `medusa`) draft from the target's hidden states, so
they are measured in the engine instead: greedy speculative decoding at a fixed k over the
same prompts, task by task, from its counters (drafts accepted, tokens per verification
step, acceptance by draft position).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tokenmill.demo import demo_model_path
from tokenmill.demo.corpus import heldout_examples, render
from tokenmill.demo.tasks import CHECKABLE_TASKS

STORY_PROMPTS = (
    "Once upon a time,",
    "There once was a little",
    "One day, Tom",
    "Long ago, in a quiet village,",
)
PROPOSAL_LENGTHS = (2, 4, 6)


def tokens_per_step(matches: Sequence[bool], k: int) -> float:
    """Replay greedy speculation: each target pass accepts the leading matches (at most k)
    and adds one token of its own; returns generated tokens per target pass."""
    position, steps = 0, 0
    while position < len(matches):
        accepted = 0
        while accepted < k and position + accepted < len(matches) and matches[position + accepted]:
            accepted += 1
        position += accepted + 1
        steps += 1
    return len(matches) / steps if steps else 0.0


@torch.no_grad()
def draft_matches(target, draft, prompt_ids: list[int], reply_ids: list[int]) -> list[bool]:
    """For each reply token: does the draft's argmax agree with the target's?"""
    ids = torch.tensor([prompt_ids + reply_ids])
    start = len(prompt_ids) - 1  # the logits at position i predict token i + 1
    end = start + len(reply_ids)
    target_next = target(ids).logits[0, start:end].argmax(-1)
    draft_next = draft(ids).logits[0, start:end].argmax(-1)
    return (target_next == draft_next).tolist()


def measure(num_per_task: int, max_tokens: int = 160) -> dict[str, dict[str, float]]:
    """Acceptance per task (chat replies) and for story continuations."""
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    target_dir, draft_dir = demo_model_path("target"), demo_model_path("draft")
    llm = LLM(model=str(target_dir), dtype="float32")
    cases: list[tuple[str, str]] = [(e.task, render(e)[0]) for e in heldout_examples(num_per_task)]
    cases += [("story", p) for p in STORY_PROMPTS]
    tokenizer = llm.get_tokenizer()
    prompt_ids = [
        tokenizer.encode(text, add_special_tokens=task == "story") for task, text in cases
    ]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    per_task: dict[str, list[list[bool]]] = {}
    for (task, _), ids, output in zip(cases, prompt_ids, outputs):
        reply = list(output.outputs[0].token_ids)
        per_task.setdefault(task, []).append(draft_matches(target, draft, ids, reply))
    per_task["all"] = [m for task, ms in per_task.items() for m in ms]
    return {task: _summarise(matches) for task, matches in per_task.items()}


def engine_acceptance(
    method: str, num_per_task: int, k: int = 4, max_tokens: int = 160, heads: str | None = None
) -> dict[str, dict[str, float]]:
    """Per task: the share of drafts accepted, tokens per verification step (the mean
    acceptance length) and the acceptance rate at each draft position, with `method`'s
    heads (default: the demo target's) at a fixed `k`."""
    import copy

    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    spec = {"method": method, "num_speculative_tokens": k, "adaptive": False, "model": heads}
    llm = LLM(dtype="float32", max_num_seqs=16, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    by_task: dict[str, list[str]] = {}
    for e in heldout_examples(num_per_task):
        by_task.setdefault(e.task, []).append(render(e)[0])
    by_task["story"] = list(STORY_PROMPTS)
    results = {}
    for task, prompts in by_task.items():
        before = copy.deepcopy(llm.get_stats().scheduler.spec_decode)
        llm.generate(prompts, params, use_tqdm=False, add_special_tokens=task == "story")
        after = llm.get_stats().scheduler.spec_decode
        assert before is not None and after is not None
        drafts = after.num_draft_tokens - before.num_draft_tokens
        steps = after.num_drafts - before.num_drafts
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        per_pos = [
            a - b
            for a, b in zip(
                after.num_accepted_tokens_per_pos,
                before.num_accepted_tokens_per_pos + [0] * k,
            )
        ]
        results[task] = {
            "num_draft_tokens": drafts,
            "acceptance": accepted / max(1, drafts),
            "mean_acceptance_length": 1 + accepted / max(1, steps),
            **{f"accept_pos{i + 1}": n / max(1, steps) for i, n in enumerate(per_pos[:k])},
        }
    return results


def format_engine_table(results: dict[str, dict[str, float]], k: int) -> str:
    header = f"{'task':<10} {'drafts':>7} {'accept':>7} {'tok/step':>9} " + " ".join(
        f"{'pos ' + str(i + 1):>6}" for i in range(k)
    )
    lines = [header]
    for task, r in results.items():
        positions = " ".join(f"{r.get(f'accept_pos{i + 1}', 0.0):>6.2f}" for i in range(k))
        lines.append(
            f"{task:<10} {r['num_draft_tokens']:>7} {r['acceptance']:>7.3f} "
            f"{r['mean_acceptance_length']:>9.2f} {positions}"
        )
    return "\n".join(lines)


def _summarise(replies: list[list[bool]]) -> dict[str, float]:
    flat = [m for reply in replies for m in reply]
    summary = {"num_tokens": len(flat), "acceptance": sum(flat) / len(flat)}
    for k in PROPOSAL_LENGTHS:
        total = sum(len(r) for r in replies)
        steps = sum(len(r) / tokens_per_step(r, k) for r in replies if r)
        summary[f"tokens_per_step_k{k}"] = total / steps
    return summary


def format_table(results: dict[str, dict[str, float]]) -> str:
    header = f"{'task':<10} {'tokens':>7} {'accept':>7} " + " ".join(
        f"{'tok/step k=' + str(k):>13}" for k in PROPOSAL_LENGTHS
    )
    lines = [header]
    for task, r in results.items():
        steps = " ".join(f"{r[f'tokens_per_step_k{k}']:>13.2f}" for k in PROPOSAL_LENGTHS)
        lines.append(f"{task:<10} {r['num_tokens']:>7} {r['acceptance']:>7.3f} {steps}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo_training.acceptance", description=__doc__)
    parser.add_argument("--num-per-task", type=int, default=30)
    parser.add_argument("--output-json", type=Path, default=None)
    parser.add_argument(
        "--method",
        default="draft",
        choices=("draft", "eagle", "medusa", "ngram", "suffix"),
        help="draft: the draft model, by teacher forcing; eagle, medusa (the demo heads), "
        "ngram, suffix: in the engine at a fixed k",
    )
    parser.add_argument("--k", type=int, default=4, help="drafts per step (eagle, medusa)")
    parser.add_argument("--heads", default=None, help="eagle, medusa: the heads' directory")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"checkable tasks: {', '.join(CHECKABLE_TASKS)}; story: plain-text continuations")
    if args.method == "draft":
        results = measure(args.num_per_task)
        print(format_table(results))
    else:
        results = engine_acceptance(args.method, args.num_per_task, args.k, heads=args.heads)
        print(format_engine_table(results, args.k))
    if args.output_json:
        args.output_json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
