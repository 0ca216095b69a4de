"""`tokenmill bench itl`: inter-token latency of decoding streams while a long prompt arrives.

    tokenmill bench itl [--model PATH] [--repeats 1]          # offline
    tokenmill bench itl --server [--llama-cpp-bin DIR]        # over HTTP

32 streams decode (64-token prompts); once every stream decodes and 16 steady steps are
timed, one 4,000-token prompt arrives. Every engine step emits one token per stream, so the
step time is the inter-token latency every stream sees. Per configuration:

- steady: the median step before the long prompt arrives;
- p99 / worst step while it is admitted (from its arrival to its first token), and p99 over
  steady;
- TTFT of the long prompt;
- throughput: tokens computed (prompt + generated) from its arrival to its first token, over
  that time (a target stretches the window, and the streams decode through it).

Offline (`LLMEngine`, steps timed in-process): the issue's fixed budgets (2048, 512, 256
chunked; 8192 unchunked), then `--itl-target-ms` at 1.5x and 2x the steady step, each measured
in its own engine just before the long prompt arrives (`--only-targets`: 2048 chunked and the
targets alone), and the issue's goal checked for each target against 2048 chunked.

`--server`: the same scenario streamed over HTTP (`/v1/completions`, token-id prompts) and
timed from chunk arrivals (itl_serving.py): `tokenmill serve` with its default budget (twice
first: the lower steady ITL of the two sets the target), then with `--itl-target-ms` at 2x
that steady ITL, then `tokenmill serve --disaggregate` (a prefill
and a decode instance on half the cores each, issue 32; `--no-disaggregate` leaves it out);
with `--llama-cpp-bin DIR` (a llama.cpp build's
binaries, e.g. llama.cpp/build/bin, inside its source tree), `llama-server` on the same weights
as f32 GGUF (converted once), one slot per request, as many threads as tokenmill uses:
its defaults, `--ubatch-size` small, and `--batch-size` small too (llama-server samples once
per `--batch-size` tokens, so a small ubatch alone still computes a whole 2048-token batch
between two tokens of a stream). Each server is started for its row and stopped after; before it
stops, a control run streams the same number of streams with no long prompt, and their median
gap at the window's token positions is the streams' own step at those contexts (their
contexts grow ~200 tokens through a window of ~25 s): issue 32's goal is checked against it,
and against the steady gap before the arrival beside it (itl_serving.py).

With no model, a random-weight model shaped like SmolLM2-135M (context 8192) is built once.
Greedy, fp32. Run several repeats on a shared machine (configurations interleaved; medians).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_itl_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint (default: a random SmolLM2-135M-shaped one, context 8192, built once)",
    )
    parser.add_argument("--streams", type=int, default=32, help="decoding streams")
    parser.add_argument(
        "--stream-prompt", type=int, default=64, help="tokens of each stream's prompt"
    )
    parser.add_argument("--long-prompt", type=int, default=4000, help="tokens of the long prompt")
    parser.add_argument(
        "--steady-steps", type=int, default=16, help="steps timed before it arrives"
    )
    parser.add_argument("--repeats", type=int, default=1, help="rounds; medians reported")
    parser.add_argument(
        "--only-targets", action="store_true", help="offline: 2048 chunked and the targets only"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=8192, help="context of the engines and servers"
    )
    parser.add_argument("--server", action="store_true", help="over HTTP, against servers")
    parser.add_argument("--llama-cpp-bin", type=Path, default=None, help="with llama-server")
    parser.add_argument("--llama-small-batch", type=int, default=64, help="-ub / -b rows")
    parser.add_argument("--llama-only", action="store_true", help="--server: no tokenmill rows")
    parser.add_argument("--stream-max-tokens", type=int, default=2048, help="--server streams")
    parser.add_argument(
        "--no-disaggregate", action="store_true", help="--server: no `serve --disaggregate` row"
    )
    parser.add_argument(
        "--recv-duty-cycles",
        type=float,
        nargs="+",
        default=[1.0],
        help="--server: one `serve --disaggregate` row per decode-side receiver duty cycle",
    )


def run_itl_command(args: argparse.Namespace) -> int:
    from tokenmill.bench.itl import run_itl  # the engine and torch: only when it runs

    return run_itl(args)
