"""The `tokenmill` command line: one subcommand per job, each a few lines here that hand over
to the module doing the work (imported when the command runs, so `--help` stays quick)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from tokenmill.entrypoints.cli_parser import CommandParser
from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tokenmill.entrypoints.http.cli_args import add_server_args
from tokenmill.entrypoints.sectioned_help import add_sectioned_help
from tokenmill.version import __version__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what data-parallel replicas run
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except (ValueError, OSError) as e:  # bad input or config: a clear message, no traceback
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl+C; `serve` has shut down cleanly before uvicorn re-raises
        return 128 + signal.SIGINT


def build_parser() -> CommandParser:
    parser = CommandParser(prog="tokenmill")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(commands)
    _add_router(commands)
    _add_tp_worker(commands)
    _add_generate(commands)
    _add_bench(commands)
    _add_eval(commands)
    _add_models(commands)
    parser.description = (
        "An LLM serving engine in the spirit of vLLM. Commands: "
        f"{', '.join(commands.choices)}; `tokenmill COMMAND --help` lists a command's flags."
    )
    return parser


def _engine_command(
    commands: argparse._SubParsersAction, name: str, **kwargs: str | None
) -> argparse.ArgumentParser:
    """A command that takes the engine flags: its `--help` lists them by section."""
    parser = commands.add_parser(name, add_help=False, **kwargs)
    add_sectioned_help(parser)
    return parser


def _add_serve(commands: argparse._SubParsersAction) -> None:
    parser = _engine_command(commands, "serve", help="serve the OpenAI-compatible HTTP API")
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model"
    )
    add_server_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.http.transport.listener import bind_listener

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"MODEL {args.model_tag!r} and --model {args.model!r} differ")
        args.model = args.model_tag
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.disaggregate and args.data_parallel_size > 1:
        raise ValueError(
            "--disaggregate runs one prefill and one decode instance: no --data-parallel-size"
        )
    events = args.kv_events_config
    if args.data_parallel_size > 1 and events is not None and events.publishes:
        raise ValueError(  # every replica would bind the one endpoint
            "--kv-events-config with --data-parallel-size: not built yet; start each replica "
            "with its own endpoint and put `tokenmill router` in front (docs/scale_out.md)"
        )
    listener = bind_listener(args.host, args.port)  # before the model and its imports load
    if args.disaggregate:
        from tokenmill.entrypoints.router.launching.serve_disaggregated import run_disaggregated

        return run_disaggregated(args, listener, args.argv)
    if args.data_parallel_size > 1:
        from tokenmill.entrypoints.router.launching.serve_data_parallel import run_data_parallel

        return run_data_parallel(args, listener, args.argv)
    from tokenmill.entrypoints.http.server import run_server

    return run_server(args, listener)


def _add_router(commands: argparse._SubParsersAction) -> None:
    from tokenmill.entrypoints.router.launching.cli_args import add_router_args

    parser = commands.add_parser(
        "router", help="one OpenAI endpoint in front of several `tokenmill serve` replicas"
    )
    add_router_args(parser)
    parser.set_defaults(handler=_router)


def _router(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.http.transport.listener import bind_listener

    if args.backend and (args.prefill or args.decode):
        raise ValueError("give either --backend or --prefill and --decode, not both")
    if not args.backend and not (args.prefill and args.decode):
        raise ValueError("the router needs --backend URL, or --prefill URL and --decode URL")
    listener = bind_listener(args.host, args.port)
    from tokenmill.entrypoints.router.launching.router_server import run_router

    run_router(args, listener, args.backend or [], args.policy)
    return 0


def _add_tp_worker(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "tp-worker",
        help="this machine's tensor-parallel ranks of an engine started elsewhere with --nnodes",
        description="Run this machine's tensor-parallel ranks of an engine that `tokenmill "
        "serve --nnodes N` started on another machine: they join it at --master-addr and "
        "--master-port and serve until it stops.",
    )
    parser.add_argument(
        "--master-addr", required=True, help="the engine's MASTER_ADDR (where its ranks meet)"
    )
    parser.add_argument("--master-port", type=int, required=True, help="its MASTER_PORT")
    parser.add_argument(
        "--node-rank", type=int, required=True, help="this machine's index: 1 .. nnodes-1"
    )
    parser.set_defaults(handler=_tp_worker)


def _tp_worker(args: argparse.Namespace) -> int:
    from tokenmill.worker.remote_workers import run_remote_workers

    return run_remote_workers(f"{args.master_addr}:{args.master_port}", args.node_rank)


def _add_generate(commands: argparse._SubParsersAction) -> None:
    from tokenmill.entrypoints import generate

    parser = _engine_command(
        commands,
        "generate",
        help="generate text for prompts, offline",
        description=generate.__doc__,
    )
    generate.add_generate_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.generate import run_generate

    return run_generate(args, vars(engine_config_from_args(args)))


def _add_bench(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("bench", help="benchmarks")
    kinds = parser.add_subparsers(dest="bench", required=True)
    throughput = _engine_command(
        kinds, "throughput", help="offline throughput against Hugging Face static batching"
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
    from tokenmill.entrypoints.llm import LLM

    if args.compare:
        return _bench_throughput_compare(args)
    config = engine_config_from_args(args)
    config.max_num_seqs = args.batch_size
    run_throughput(args, LLM(**vars(config)))
    return 0


def _bench_throughput_compare(args: argparse.Namespace) -> int:
    """`--compare NAME="FLAGS" ...`: one engine per entry, the command's engine flags with
    FLAGS on top."""
    import copy
    import shlex

    from tokenmill.bench.throughput import parse_compare, run_compare
    from tokenmill.entrypoints.llm import LLM

    configs = {}
    for name, flags in parse_compare(args.compare).items():
        parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        add_engine_args(parser)
        try:  # flags not given keep the command's values (already in the namespace)
            config_args, unknown = parser.parse_known_args(shlex.split(flags), copy.copy(args))
        except argparse.ArgumentError as e:
            raise ValueError(f"--compare {name}: {e}") from None
        if unknown:
            raise ValueError(f"--compare {name}: not an engine flag: {' '.join(unknown)}")
        configs[name] = engine_config_from_args(config_args)
        configs[name].max_num_seqs = args.batch_size
    run_compare(args, {name: LLM(**vars(config)) for name, config in configs.items()})
    return 0


def _add_eval(commands: argparse._SubParsersAction) -> None:
    parser = _engine_command(
        commands, "eval", help="exact-match accuracy per task of the demo model on held-out prompts"
    )
    from tokenmill.entrypoints.demo_commands import add_eval_args

    add_eval_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=_eval)


def _eval(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.demo_commands import run_eval

    return run_eval(args)


def _add_models(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("models", help="list the built-in models and what they can do")
    parser.set_defaults(handler=_models)


def _models(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.demo_commands import run_models

    return run_models(args)


if __name__ == "__main__":
    sys.exit(main())
