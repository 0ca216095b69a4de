"""How long an innocent 4-token request and /health take while another client attacks the
server: (a) a 60,000-prompt completion whose client leaves after 1 s, (b) three 1.8 MB
/tokenize bodies and one 1.8 MB prompt at once.

    python -m benchmarks.abuse_probe [--model DIR]

Starts `tokenmill serve` (the demo model unless --model) on a free port, prints the seconds
each probe took and what each attack got back, and stops the server.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

KEY = "sk-probe"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--port", str(port)]
    command += ["--api-key", KEY, "--disable-uvicorn-access-log", "--disable-log-stats"]
    command += [args.model] if args.model else []
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url)
        with httpx.Client(base_url=url, headers=HEADERS, timeout=600) as http:
            print(f"baseline: probe {_probe(http):.2f} s")
            _flood(http)
            _huge_bodies(http)
    finally:
        server.terminate()
        server.wait(60)


def _flood(http: httpx.Client) -> None:
    body = {"prompt": [[5, 6]] * 60_000, "max_tokens": 16, "ignore_eos": True}
    start = time.perf_counter()
    try:
        response = http.post("/v1/completions", json=body, timeout=1.0)
        status: Any = f"{response.status_code} {response.text[:120]}"
    except httpx.ReadTimeout:
        status = "client left after 1 s"
    answered = time.perf_counter() - start
    print(f"flood of 60,000 prompts: {status} after {answered:.2f} s; probe {_probe(http):.2f} s")


def _huge_bodies(http: httpx.Client) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 40_000
    statuses: list[int] = []

    def send(path: str, body: dict[str, Any]) -> None:
        with contextlib.suppress(httpx.HTTPError):
            statuses.append(http.post(path, json=body).status_code)

    attacks = [threading.Thread(target=send, args=("/tokenize", {"prompt": text})) for _ in "abc"]
    attacks.append(threading.Thread(target=send, args=("/v1/completions", {"prompt": text})))
    for attack in attacks:
        attack.start()
    time.sleep(0.2)
    start = time.perf_counter()
    http.get("/health")
    health = time.perf_counter() - start
    probe = _probe(http)
    for attack in attacks:
        attack.join()
    print(f"4 bodies of 1.8 MB: {statuses}; /health {health:.2f} s, probe {probe:.2f} s")


def _probe(http: httpx.Client) -> float:
    start = time.perf_counter()
    response = http.post("/v1/completions", json={"prompt": "probe", "max_tokens": 4})
    response.raise_for_status()
    return time.perf_counter() - start


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError("the server did not start")


if __name__ == "__main__":
    main()
