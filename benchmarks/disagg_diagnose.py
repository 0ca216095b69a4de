"""Where the streams' worst gaps come from under `serve --disaggregate`: the ITL scenario once,
then the decode instance's own step times and KV transfers (from its dashboard stream), the
slowest steps beside the slowest gaps the client saw.

    python -m benchmarks.disagg_diagnose [--long-prompt 4000] [--streams 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

import httpx

from tokenmill.bench.itl import smollm2_shaped_model
from tokenmill.bench.itl_serving import Scenario, run_scenario, tokenmill_server


def dashboard_update(url: str) -> tuple[dict, dict]:
    with (
        httpx.Client(base_url=url, timeout=60) as http,
        http.stream("GET", "/dashboard/events") as response,
    ):
        setup, name = {}, None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if name == "setup":
                    setup = data
                else:
                    return setup, data
    raise RuntimeError("no update")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--long-prompt", type=int, default=4000)
    parser.add_argument("--flags", default="")
    parser.add_argument(
        "--renice-decode",
        type=int,
        default=None,
        help="a diagnostic on a shared machine: the decode instance's nice value (root), so "
        "that other jobs moved onto its cores while the prefill core is busy slow it less",
    )
    parser.add_argument("--renice-prefill", type=int, default=None, help="its nice value")
    parser.add_argument("--client-cpus", default=None, help="pin this client, e.g. 0")
    args = parser.parse_args()
    model = smollm2_shaped_model()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    scenario = Scenario(streams=args.streams, long_prompt=args.long_prompt, vocab_size=vocab)
    log = Path(tempfile.mkdtemp(prefix="disagg-diagnose-")) / "serve.log"
    flags = ["--disaggregate", *args.flags.split()]
    with tokenmill_server(model, 8192, flags, log) as server:
        text = log.read_text()
        prefill_url, decode_url = re.search(
            r"prefill instance on (\S+) .* decode instance on (\S+) ", text
        ).groups()
        if args.renice_prefill is not None:
            prefill_pid = re.search(r"prefill instance on \S+ \(pid (\d+)", text)[1]
            threads = [t.name for t in Path(f"/proc/{prefill_pid}/task").iterdir()]
            subprocess.run(["renice", "-n", str(args.renice_prefill), "-p", *threads], check=True)
        if args.renice_decode is not None:
            decode_pid = re.search(r"decode instance on \S+ \(pid (\d+)", text)[1]
            threads = [t.name for t in Path(f"/proc/{decode_pid}/task").iterdir()]  # each one
            subprocess.run(["renice", "-n", str(args.renice_decode), "-p", *threads], check=True)
        if args.client_cpus is not None:
            os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
        run = asyncio.run(run_scenario(server.base_url, scenario))
        _, decode = dashboard_update(decode_url)
        _, prefill = dashboard_update(prefill_url)
    gaps = sorted(run.admission_itls)
    print(
        f"client: steady {run.steady * 1000:.0f} ms, p99 {run.p99 * 1000:.0f} ms, "
        f"worst {gaps[-1] * 1000:.0f} ms, TTFT {run.ttft:.1f} s"
    )
    steps = decode["steps"]  # [time, seconds, prefill, decode, num_reqs, k, preempted]
    median = statistics.median(s[1] for s in steps)
    print(f"decode instance: {len(steps)} steps, median {median * 1000:.0f} ms; slowest:")
    long_transfer = max(decode["kv_transfers"], key=lambda t: t[3], default=None)
    if long_transfer is not None:  # the long prompt's: steps by phase, in the decode's clock
        end, start = long_transfer[0], long_transfer[0] - long_transfer[4]
        arrival = end - run.ttft
        phases = {
            "before the long prompt": (arrival - 10.0, arrival),
            "while it is prefilled": (arrival, start),
            "while its KV arrives": (start, end),
            "after": (end, end + 5.0),
        }
        for name, (t0, t1) in phases.items():
            times = sorted(s[1] for s in steps if t0 <= s[0] < t1)
            if times:
                print(
                    f"  {name}: {len(times)} steps, median {statistics.median(times) * 1000:.0f}"
                    f" ms, max {times[-1] * 1000:.0f} ms"
                )
    for s in sorted(steps, key=lambda s: -s[1])[:8]:
        print(f"  t={s[0]:.3f} {s[1] * 1000:.0f} ms prefill={s[2]} decode={s[3]} reqs={s[4]}")
    for name, update in (("decode", decode), ("prefill", prefill)):
        for t in update["kv_transfers"]:
            print(
                f"{name} transfer: ended t={t[0]:.3f} {t[2]} {t[3] / 1e6:.1f} MB "
                f"in {t[4]:.3f} s error={t[5]}"
            )


if __name__ == "__main__":
    main()
