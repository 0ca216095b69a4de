"""ServerProcess: a server and every process it started are gone after the stop."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from tokenmill.bench.server_process import ServerProcess

# A server that starts a child of its own (as vLLM starts its engine core), writes the
# child's pid, and answers /health; it ignores SIGTERM, as a server stuck in a drain would.
FAKE_SERVER = """
import http.server, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[2], "w").write(str(child.pid))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class FakeServer(ServerProcess):
    name = "fake server"

    def __init__(self, log: Path, pid_file: Path) -> None:
        super().__init__([], log, start_timeout=30, stop_timeout=1, env={**os.environ, "X": "1"})
        self.pid_file = pid_file

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-c", FAKE_SERVER, str(self.port), str(self.pid_file)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # not an unreaped zombie


def test_stop_ends_the_server_and_its_children_even_when_it_ignores_sigterm(
    tmp_path: Path,
) -> None:
    pid_file = tmp_path / "child.pid"
    with FakeServer(tmp_path / "log", pid_file) as server:
        assert server.process is not None
        assert os.getpgid(server.process.pid) == server.process.pid  # a group of its own
        child = int(pid_file.read_text())
        assert alive(child)
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not alive(child)
        assert server.process.poll() is not None
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)  # it ignores SIGTERM, as its parent did
