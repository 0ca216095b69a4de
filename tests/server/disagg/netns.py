"""Two test "hosts" on one machine: network namespaces joined by a veth pair (needs root and
`ip`), each with its own loopback and one address on the link. Traffic stays on addresses of
the namespaces made here; they are deleted (with the link) afterwards."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# Runs inside a namespace: wait for a URL's /health, then (if given) POST a JSON body; prints
# {"status": ..., "body": ...}.
_CLIENT = textwrap.dedent(
    """
    import json, sys, time, httpx
    base, path, body, key, timeout = sys.argv[1:6]
    headers = {"Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + float(timeout)
    while True:
        try:
            if httpx.get(base + "/health", headers=headers, timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            print(json.dumps({"status": None, "body": "never healthy"})); sys.exit()
        time.sleep(0.3)
    if path == "-":
        print(json.dumps({"status": 200, "body": None})); sys.exit()
    answer = httpx.post(base + path, json=json.loads(body), headers=headers, timeout=120)
    print(json.dumps({"status": answer.status_code, "body": answer.json()}))
    """
)


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str  # on the link to the other host
    interface: str

    def command(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *args]

    def start(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        log = log_path.open("wb")
        return subprocess.Popen(
            self.command(*args), stdout=log, stderr=subprocess.STDOUT, env=env or os.environ.copy()
        )

    def request(
        self, base: str, path: str, body: dict | None, key: str, timeout: float = 300
    ) -> dict:
        """Wait until `base` is healthy (seen from this host), then POST `body` to `path`
        (`path` "-": only wait)."""
        command = self.command(
            sys.executable, "-c", _CLIENT, base, path, json.dumps(body or {}), key, str(timeout)
        )
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout + 60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"tm-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


@contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    tag = f"{os.getpid() % 10000}{random.randrange(100)}"
    subnet = random.randrange(1, 250)
    hosts = (
        Host(f"tm-a-{tag}", f"10.231.{subnet}.1", f"tma{tag}"),
        Host(f"tm-b-{tag}", f"10.231.{subnet}.2", f"tmb{tag}"),
    )
    try:
        for host in hosts:
            _ip("netns", "add", host.namespace)
        _ip("link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface)
        for host in hosts:
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for host in hosts:  # the veth pair goes with them
            subprocess.run(["ip", "netns", "del", host.namespace], check=False)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)
