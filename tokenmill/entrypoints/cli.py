"""`tokenmill serve | generate | bench`."""

from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tokenmill.entrypoints.openai.cli_args import add_server_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve(commands)
    _add_generate(commands)
    _add_bench(commands)
    _add_eval(commands)
    _add_models(commands)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except (ValueError, OSError) as e:  # bad input or config: a clear message, no traceback
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2


def _add_serve(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model"
    )
    add_server_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.openai.server import run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ")
        args.model = args.model_tag
    return run_server(args)


def _add_generate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("generate", help="generate text for prompts, offline")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--stop", action="append", default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    add_engine_args(parser)
    parser.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    llm = LLM(**vars(engine_config_from_args(args)))
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for prompt, output in zip(args.prompt, outputs):
        for completion in output.outputs:
            print(
                f"--- prompt: {prompt!r} [sample {completion.index}, "
                f"{len(completion.token_ids)} tokens, {completion.finish_reason}]"
            )
            print(completion.text)
    return 0


def _add_bench(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("bench", help="benchmarks")
    kinds = parser.add_subparsers(dest="bench", required=True)
    throughput = kinds.add_parser(
        "throughput", help="offline throughput against Hugging Face static batching"
    )
    from tokenmill.bench.throughput import add_throughput_args

    add_throughput_args(throughput)
    add_engine_args(throughput)
    throughput.set_defaults(handler=_bench_throughput)
    _add_bench_serving(kinds)


def _add_bench_serving(kinds: argparse._SubParsersAction) -> None:
    """`bench serve | sweep | compare`: load generators for any OpenAI-compatible server."""
    from tokenmill.bench.commands import add_serving_benchmarks

    add_serving_benchmarks(kinds)


def _bench_throughput(args: argparse.Namespace) -> int:
    from tokenmill.bench.throughput import run_throughput

    run_throughput(args, engine_config_from_args(args))
    return 0


def _add_eval(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "eval", help="exact-match accuracy per task of the demo model on held-out prompts"
    )
    from tokenmill.demo.commands import add_eval_args

    add_eval_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=_eval)


def _eval(args: argparse.Namespace) -> int:
    from tokenmill.demo.commands import run_eval

    return run_eval(args)


def _add_models(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("models", help="list the built-in models and what they can do")
    parser.set_defaults(handler=_models)


def _models(args: argparse.Namespace) -> int:
    from tokenmill.demo.commands import run_models

    return run_models(args)


if __name__ == "__main__":
    sys.exit(main())
