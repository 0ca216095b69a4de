"""The `tokenmill eval` and `tokenmill models` subcommands (registered in entrypoints/cli.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tokenmill.demo.corpus import EVAL_SEED
from tokenmill.demo.tasks import CHECKABLE_TASKS


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    from tokenmill.demo.eval import BAR_NUM_PER_TASK

    group = parser.add_argument_group("eval")
    group.add_argument(
        "--tasks",
        default=",".join(CHECKABLE_TASKS),
        help=f"comma-separated subset of {','.join(CHECKABLE_TASKS)}",
    )
    group.add_argument(
        "--num-per-task",
        type=int,
        default=BAR_NUM_PER_TASK,
        help="held-out examples per task (a prefix of a fixed stream)",
    )
    group.add_argument("--eval-seed", type=int, default=EVAL_SEED, help="held-out set seed")
    group.add_argument(
        "--url", default=None, help="evaluate a running server (e.g. http://localhost:8000)"
    )
    group.add_argument("--served-model-name", default=None, help="with --url; default: first")
    group.add_argument(
        "--api-key",
        default=os.environ.get("TOKENMILL_API_KEY"),
        help="with --url: the server's API key (default: $TOKENMILL_API_KEY, as `serve` reads)",
    )
    group.add_argument("--concurrency", type=int, default=32, help="with --url: parallel requests")
    group.add_argument("--output-json", type=Path, default=None, help="write the scores here")
    group.add_argument(
        "--check", action="store_true", help="exit 1 if a task is below its documented bar"
    )
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    group.add_argument(
        "--show-failures", type=int, default=0, metavar="N", help="print N wrong replies per task"
    )


def run_eval(args: argparse.Namespace) -> int:
    from tokenmill.demo.eval import (
        ACCURACY_BARS,
        evaluate,
        heldout,
        offline_replies,
        server_replies,
    )

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(CHECKABLE_TASKS))
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; choose from {list(CHECKABLE_TASKS)}")
    if args.num_per_task < 1:
        raise ValueError(f"--num-per-task must be >= 1, got {args.num_per_task}")
    examples = heldout(args.num_per_task, tasks, seed=args.eval_seed)
    if args.url:
        reply_fn = server_replies(
            args.url,
            args.served_model_name,
            args.concurrency,
            args.api_key,
            progress=not args.disable_tqdm,
        )
        source = args.url
    else:
        llm = _offline_llm(args)
        reply_fn = offline_replies(llm, progress=not args.disable_tqdm)
        source = str(llm.engine.parts.model_dir)
    report = evaluate(examples, reply_fn)
    print(f"{len(examples)} held-out prompts (seed {args.eval_seed}) -> {source}")
    print(report.table(ACCURACY_BARS))
    _print_failures(report, args.show_failures)
    if args.output_json:
        args.output_json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    below = report.below_bars(ACCURACY_BARS)
    if args.check and below:
        print(f"below the documented bar: {', '.join(below)}", file=sys.stderr)
        return 1
    return 0


def _offline_llm(args: argparse.Namespace):
    from tokenmill.demo import demo_model_path
    from tokenmill.entrypoints.engine_args import engine_config_from_args
    from tokenmill.entrypoints.llm import LLM

    config = engine_config_from_args(args)
    if config.model is None:  # the eval is about the demo model, whatever the default is
        config.model = str(demo_model_path("target"))
    return LLM(**vars(config))


def _print_failures(report, count: int) -> None:
    for score in report.scores.values():
        for example, reply in score.failures[:count]:
            print(f"--- {score.task}: {example.prompt!r}")
            print(f"    expected {example.answer!r}\n    got      {reply!r}")


def run_models(args: argparse.Namespace) -> int:
    from tokenmill.demo.catalog import describe_models

    print(describe_models())
    return 0
