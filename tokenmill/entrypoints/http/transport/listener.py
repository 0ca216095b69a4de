"""The server's listening socket, bound before the model loads (as vLLM does): a port in use is
a one-line error within seconds, not after the model has loaded and a log line has claimed it.
Light to import, so the check runs before torch and the server's modules load."""

from __future__ import annotations

import errno
import socket


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket, bound now; an `OSError` that says what to do when it can't be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        listener.bind((host, port))
    except OSError as e:
        listener.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(
                f"port {port} on {host} is already in use (another server?); "
                "choose another with --port"
            ) from e
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    return listener
