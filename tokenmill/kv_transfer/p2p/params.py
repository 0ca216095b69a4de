"""`kv_transfer_params`, vLLM's names: what a request carries to and from the P2P connector.

To a prefill instance (the producer): `{"do_remote_decode": true}` (and, for a request whose
`n` samples will each read the KV, `"num_consumers": n`). It runs the prompt with
`max_tokens=1` and, if it finishes by that length, keeps the KV blocks and answers with:

    {"do_remote_prefill": true, "remote_engine_id": ..., "remote_host": ..., "remote_port": ...,
     "remote_request_id": ..., "remote_num_tokens": ..., "remote_prompt_digest": ...}

which the router hands to a decode instance (the consumer) with the same request. The digest
(SHA-256 of the prompt's token ids and its `cache_salt`) is checked by both sides before a
byte moves: a request can only ever read the KV of its own prompt and tenant.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Any

from tokenmill.step.request import Request


class TransferParamsError(ValueError):
    pass


def prompt_digest(request: Request) -> str:
    digest = hashlib.sha256(b"tokenmill-kv-prompt\0")
    digest.update((request.cache_salt or "").encode() + b"\0")
    digest.update(array("q", request.prompt_token_ids).tobytes())
    return digest.hexdigest()


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def num_consumers(params: dict[str, Any] | None) -> int:
    value = (params or {}).get("num_consumers", 1)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1024:
        raise TransferParamsError(f"num_consumers must be an integer in [1, 1024], got {value!r}")
    return value


_FIELDS = {
    "engine_id": ("remote_engine_id", str),
    "host": ("remote_host", str),
    "port": ("remote_port", int),
    "request_id": ("remote_request_id", str),
    "num_tokens": ("remote_num_tokens", int),
    "prompt_digest": ("remote_prompt_digest", str),
}


@dataclass(frozen=True)
class RemotePrefill:
    """Where a request's prompt KV waits, from the producer's `kv_transfer_params`."""

    engine_id: str
    host: str
    port: int
    request_id: str
    num_tokens: int
    prompt_digest: str

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def as_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False}
        for name, (key, _) in _FIELDS.items():
            params[key] = getattr(self, name)
        return params

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> RemotePrefill | None:
        """None for params that ask for no remote prefill; TransferParamsError for params
        that do but are malformed."""
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            return None
        values = {}
        for name, (key, kind) in _FIELDS.items():
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise TransferParamsError(f"kv_transfer_params.{key} must be a {kind.__name__}")
            values[name] = value
        if not 0 < values["port"] < 65536:
            raise TransferParamsError("kv_transfer_params.remote_port must be a port number")
        return cls(**values)
