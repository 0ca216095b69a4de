"""A `tokenmill serve` subprocess on a free loopback port: started, awaited, stopped.

`bench compare` and the end-to-end tests need real servers with different flags, one at a
time. Everything here is bounded: the start waits at most `start_timeout` seconds (and stops
early when the process exits, e.g. on a flag it does not know), and the stop escalates from
SIGTERM to SIGKILL of this one process after `stop_timeout`.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

HOST = "127.0.0.1"


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message carries its log's tail."""


def free_port() -> int:
    """A port the OS says is free now (another process could still take it before we do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerProcess:
    """`with ServerProcess(["--model", path]) as server: ... server.base_url ...`"""

    name = "tokenmill serve"  # in errors; a subclass for another server overrides `command`

    def __init__(
        self,
        server_args: list[str],
        log_path: str | Path,
        start_timeout: float = 300.0,
        stop_timeout: float = 30.0,
    ) -> None:
        self.server_args = list(server_args)
        self.log_path = Path(log_path)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "tokenmill.entrypoints.cli", "serve",
            "--host", HOST, "--port", str(self.port), "--disable-uvicorn-access-log",
            *self.server_args,
        ]  # fmt: skip

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self._wait_until_healthy()

    def _wait_until_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"`{self.name}` exited with code {self.process.returncode}: {self.log_tail()}"
                )
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0, trust_env=False).is_success:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.25)
        self.stop()
        raise ServerStartError(
            f"no healthy server after {self.start_timeout:.0f} s: {self.log_tail()}"
        )

    def stop(self) -> None:
        """SIGTERM (the server drains and exits), then SIGKILL if it takes too long."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(self.stop_timeout)

    def log_tail(self, num_lines: int = 8) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-num_lines:]) or "(empty log)"

    def __enter__(self) -> ServerProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
