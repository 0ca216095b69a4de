"""The routing policies for real: R tiny-model `tokenmill serve` replicas on this machine, a
`tokenmill router` per policy in front of them, the route simulator's workload scaled down,
and the measured prefix-hit rate next to the simulated one.

    python -m benchmarks.route_real --replicas 2

Prompts are token ids (each tenant's system prompt, then a unique user part), so the router
hashes their first ids. The replicas' KV caches are made small (`--kv-tokens` each) so that
round-robin, which shows every tenant to every replica, evicts. The hit rate is the
replicas' prefix_cache_hits / prefix_cache_queries over the run (tokens), read from the
router's aggregated /metrics; the caches are reset before each policy.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.route_sim import Workload, make_requests, simulate
from tokenmill.bench.server_process import ServerProcess, free_port
from tokenmill_testing.random_checkpoint import save_random_checkpoint

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32
POLICIES = ("round-robin", "least-loaded", "prefix-aware")


def start_router(backends: list[str], policy: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "router", "--port", str(port),
               "--policy", policy]  # fmt: skip
    for url in backends:
        command += ["--backend", url]
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(log.read_text())


def prefix_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    hits = queries = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tokenmill:prefix_cache_hits_total":
                hits += sample.value
            elif sample.name == "tokenmill:prefix_cache_queries_total":
                queries += sample.value
    return hits, queries


async def send_all(url: str, prompts: list[tuple[float, list[int]]]) -> list[float]:
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(at: float, prompt: list[int], start: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            t = time.monotonic()
            body = {"model": "m", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            latencies.append(time.monotonic() - t)

        start = time.monotonic()
        await asyncio.gather(*(one(at, p, start) for at, p in prompts))
    return latencies


def _random_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(16, 1000) for _ in range(length)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--kv-tokens", type=int, default=2048, help="KV capacity per replica")
    args = parser.parse_args()
    workload = Workload(
        num_tenants=args.tenants,
        system_tokens=(200, 600),
        user_tokens=(8, 32),
        output_tokens=(4, 4),
        num_requests=args.requests,
    )
    requests, _ = make_requests(workload, args.rate)
    rng = random.Random(1)
    systems = {t: _random_ids(random.Random(1000 + t), 600) for t in range(args.tenants)}
    prompts = [
        (
            r.arrival,
            systems[r.tenant][: r.system] + [rng.randrange(16, 1000) for _ in range(r.user)],
        )
        for r in requests
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_checkpoint(Path(tmp) / "model", "llama")
        server_args = [str(model), "--served-model-name", "m", "--max-model-len", "1024",
                       "--kv-cache-memory", str(args.kv_tokens * BYTES_PER_TOKEN),
                       "--disable-log-stats"]  # fmt: skip
        replicas = [
            ServerProcess(server_args, Path(tmp) / f"replica{i}.log", start_timeout=600)
            for i in range(args.replicas)
        ]
        try:
            for replica in replicas:
                replica.start()
            print("| policy | measured hit rate | simulated hit rate | latency p50 (s) |")
            print("|---|---|---|---|")
            for policy in POLICIES:
                process, url = start_router(
                    [r.base_url for r in replicas], policy, Path(tmp) / f"router-{policy}.log"
                )
                try:
                    httpx.post(url + "/reset_prefix_cache", timeout=30).raise_for_status()
                    hits0, queries0 = prefix_counters(url)
                    latencies = asyncio.run(send_all(url, prompts))
                    hits1, queries1 = prefix_counters(url)
                finally:
                    process.terminate()
                    process.wait(30)
                simulated = simulate(
                    policy, requests, args.replicas, args.kv_tokens, (0.01, 0.0, 0.0001, 0.0)
                )["hit_rate"]
                measured = (hits1 - hits0) / max(1.0, queries1 - queries0)
                print(
                    f"| {policy} | {measured:.3f} | {simulated:.3f} "
                    f"| {statistics.median(latencies):.3f} |",
                    flush=True,
                )
        finally:
            for replica in replicas:
                replica.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
