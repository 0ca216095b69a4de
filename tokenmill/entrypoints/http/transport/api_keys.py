"""The API keys a server or router accepts: `--api-key KEY` (repeatable; without it
$TOKENMILL_API_KEY) and `--api-key-file PATH` (one key a line). With none, every route is open.

Each key is a client of its own: a stored response belongs to the key that stored it
(http/responses/store.py). Light (standard library only): the router imports it.
"""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

ENV_VAR = "TOKENMILL_API_KEY"


class HasState(Protocol):
    """A Starlette request, as far as this module needs one."""

    @property
    def state(self) -> Any: ...


@dataclass(frozen=True)
class ApiKeys:
    keys: tuple[str, ...] = ()

    @classmethod
    def of(cls, value: ApiKeys | str | Iterable[str] | None) -> ApiKeys:
        """`value` as keys: None is none, a string is one key."""
        if isinstance(value, ApiKeys):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls((value,))
        return cls(tuple(dict.fromkeys(value)))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def match(self, given: str) -> str | None:
        """The key equal to `given`, else None. Every key is compared, each in constant time,
        so the time taken tells nothing of which key (if any) matched."""
        found = None
        for key in self.keys:
            if secrets.compare_digest(given.encode(), key.encode()):
                found = key
        return found

    @property
    def first(self) -> str | None:
        """The key a router sends on its own requests to replicas (health checks, scrapes)."""
        return self.keys[0] if self.keys else None


def add_api_key_args(group: argparse._ArgumentGroup, what: str) -> None:
    """`--api-key` and `--api-key-file`; `what` says which routes need a key."""
    group.add_argument(
        "--api-key",
        action="append",
        default=None,
        help=f"require this bearer token {what}; repeat for several keys, each a client of "
        f"its own (stored responses are visible only to the key that stored them) "
        f"(default: ${ENV_VAR})",
    )
    group.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="more keys, one a line (blank lines and lines starting with # are skipped)",
    )


def api_keys_from_args(args: argparse.Namespace) -> ApiKeys:
    """The keys `--api-key` and `--api-key-file` give; $TOKENMILL_API_KEY without `--api-key`."""
    given = getattr(args, "api_key", None)
    if isinstance(given, str):  # a namespace built by hand
        given = [given]
    keys = list(given) if given else []
    if not keys and os.environ.get(ENV_VAR):
        keys.append(os.environ[ENV_VAR])
    path = getattr(args, "api_key_file", None)
    if path is not None:
        keys.extend(read_key_file(Path(path)))
    for key in keys:
        if not key.strip() or key != key.strip():
            raise ValueError("an API key must be non-empty, without surrounding whitespace")
    return ApiKeys.of(keys)


def read_key_file(path: Path) -> list[str]:
    """The keys in `path`, one a line; ValueError (a clear CLI error) when it holds none."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--api-key-file {path}: {e.strerror or e}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key")
    return keys


def remember_key(request: HasState, key: str | None) -> None:
    """Note on the request which key it came with (the check that matched it calls this)."""
    request.state.api_key = key


def request_key(request: HasState) -> str | None:
    """The key the request came with, as its key check noted; None on a server without keys."""
    return getattr(request.state, "api_key", None)
