"""The `tokenmill bench serve | sweep | compare | itl | embed | make-model` subcommands: parsers and
error handling.

Kept apart from the command modules so that `tokenmill --help` stays cheap and each command's
failure (a server that is down, a bad flag value) ends in one clear line, not a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from tokenmill.bench.client import BenchError
from tokenmill.bench.server_process import ServerStartError


def add_serving_benchmarks(kinds: argparse._SubParsersAction) -> None:
    from tokenmill.bench import compare, embed, itl_command, random_model, serve, sweep

    _add(
        kinds,
        "serve",
        "load-test an OpenAI-compatible server",
        serve.add_serve_args,
        serve.run_serve,
    )
    _add(
        kinds,
        "sweep",
        "bench serve over rising load; table, knee and plots",
        sweep.add_sweep_args,
        sweep.run_sweep_cli,
    )
    _add(
        kinds,
        "compare",
        "the same workload against several server configurations",
        compare.add_compare_args,
        compare.run_compare_cli,
    )
    _add(
        kinds,
        "itl",
        "inter-token latency of decoding streams while a long prompt arrives",
        itl_command.add_itl_args,
        itl_command.run_itl_command,
    )
    _add(
        kinds,
        "embed",
        "embedding throughput and latency against sentence-transformers",
        embed.add_embed_args,
        embed.run_embed,
    )
    _add(
        kinds,
        "make-model",
        "write a random-weight Llama of a benchmark's shape (prints its directory)",
        random_model.add_make_model_args,
        random_model.run_make_model,
    )


def _add(
    kinds: argparse._SubParsersAction,
    name: str,
    help_text: str,
    add_args: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    parser = kinds.add_parser(
        name,
        help=help_text,
        description=sys.modules[run.__module__].__doc__,
    )
    add_args(parser)
    parser.set_defaults(handler=lambda args: _guarded(run, args))


def _guarded(run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return run(args)
    except (BenchError, ServerStartError) as e:
        print(f"tokenmill bench: error: {e}", file=sys.stderr)
        return 1
