"""One stored KV block per file: a header line (JSON: shape, dtype, SHA-256 of the payload),
then the payload, every layer's keys and values of the block as raw bytes.

Written to a temporary name and renamed into place, so a reader (another engine on the same
directory) sees a whole file or none; read back only when the header matches what the reader
expects and the payload's digest matches the header's.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"tokenmill-kv-block 1\n"


class CorruptBlockError(ValueError):
    """A stored block whose header or checksum does not match: never loaded."""


@dataclass(frozen=True)
class BlockLayout:
    """The payload of one block: uint8 `[num_layers, 2, block_size, kv_heads, head_bytes]`,
    `head_bytes` being head_dim times the storage dtype's size (FP8 included)."""

    shape: tuple[int, ...]
    dtype: str  # the KV storage dtype the bytes are of

    @property
    def num_bytes(self) -> int:
        size = 1
        for dim in self.shape:
            size *= dim
        return size


def write_block(path: Path, payload: torch.Tensor, layout: BlockLayout) -> None:
    data = payload.contiguous().numpy().tobytes()
    header = {"shape": list(layout.shape), "dtype": layout.dtype}
    header["sha256"] = hashlib.sha256(data).hexdigest()
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    with open(temporary, "wb") as file:
        file.write(MAGIC)
        file.write(json.dumps(header).encode() + b"\n")
        file.write(data)
    os.replace(temporary, path)


def read_block(path: Path, layout: BlockLayout) -> torch.Tensor:
    """The block's payload, uint8 in `layout.shape`. Raises FileNotFoundError for a block
    never stored, CorruptBlockError for one that fails its checks."""
    with open(path, "rb") as file:
        if file.readline() != MAGIC:
            raise CorruptBlockError(f"{path}: not a tokenmill KV block file")
        try:
            header = json.loads(file.readline())
        except ValueError as e:
            raise CorruptBlockError(f"{path}: unreadable header ({e})") from e
        data = file.read(layout.num_bytes + 1)
    if not isinstance(header, dict) or (
        tuple(header.get("shape", ())),
        header.get("dtype"),
    ) != (layout.shape, layout.dtype):
        raise CorruptBlockError(f"{path}: stored for another KV layout ({header})")
    if len(data) != layout.num_bytes:
        raise CorruptBlockError(f"{path}: {len(data)} payload bytes, expected {layout.num_bytes}")
    if hashlib.sha256(data).hexdigest() != header.get("sha256"):
        raise CorruptBlockError(f"{path}: checksum mismatch")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(layout.shape)
