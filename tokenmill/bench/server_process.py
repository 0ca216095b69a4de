"""A `tokenmill serve` subprocess on a free loopback port: started, awaited, stopped.

`bench compare` and the end-to-end tests need real servers with different flags, one at a
time. Everything here is bounded: the start waits at most `start_timeout` seconds (and stops
early when the process exits, e.g. on a flag it does not know), and the stop escalates from
SIGTERM to SIGKILL after `stop_timeout`. The server starts in a process group of its own, and
the stop ends with SIGKILL to that group: no child of the server (vLLM's engine core, a
replica) outlives it, even when the server itself died first.
"""

from __future__ import annotations

import contextlib
import os
import signal
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
        env: dict[str, str] | None = None,
    ) -> None:
        self.server_args = list(server_args)
        self.env = env  # the server's whole environment; None: this process's
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
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
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
        """SIGTERM (the server drains and exits), SIGKILL if it takes too long, then SIGKILL
        to whatever is left in its process group."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(self.stop_timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone
            os.killpg(self.process.pid, signal.SIGKILL)

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
