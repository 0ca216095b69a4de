"""Opening a GGUF file, with one line for each way it can be wrong: missing, not GGUF at all,
a version the reader does not know, or cut short (with how long it is and how long it must
be), instead of the gguf package's numpy errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

from tokenmill.config import ConfigError

_MAGIC = b"GGUF"
_HEADER_BYTES = 8  # the magic and the version


def open_gguf(path: Path) -> GGUFReader:
    """The file's reader (memory-mapped: nothing is read into memory yet)."""
    if not path.exists():
        raise ConfigError(f"{path} does not exist")
    if not path.is_file():
        raise ConfigError(f"{path} is not a file (a GGUF model is one .gguf file)")
    with path.open("rb") as f:
        header = f.read(_HEADER_BYTES)
    size = path.stat().st_size
    if not _MAGIC.startswith(header[:4]):
        raise ConfigError(f"{path} is not a GGUF file: it starts with {header[:4]!r}, not b'GGUF'")
    if len(header) < _HEADER_BYTES:
        raise _truncated(path, size, _HEADER_BYTES, "header")
    version = int.from_bytes(header[4:8], "little")
    if version & 0xFFFF == 0:  # written on a big-endian machine
        version = int.from_bytes(header[4:8], "big")
    if version not in READER_SUPPORTED_VERSIONS:
        supported = ", ".join(str(v) for v in READER_SUPPORTED_VERSIONS)
        raise ConfigError(f"{path}: GGUF version {version} is not supported (only {supported})")
    try:
        return _CheckedReader(path)
    except _PastTheEnd as e:
        raise _truncated(path, size, e.needed, e.part) from None
    except (ValueError, KeyError, IndexError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not a valid GGUF file: {e}") from None


def _truncated(path: Path, size: int, needed: int, part: str) -> ConfigError:
    return ConfigError(
        f"{path} is truncated: it is {size:,} bytes, but its {part} needs at least "
        f"{needed:,}; an interrupted download? fetch it again"
    )


class _PastTheEnd(Exception):
    def __init__(self, needed: int, part: str) -> None:
        super().__init__(needed, part)
        self.needed, self.part = needed, part


class _CheckedReader(GGUFReader):
    """The gguf package's reader, stopping at the first read past the end of the file (it
    would go on with a shorter array and fail in numpy), and checking the tensor data's full
    length before reading any tensor."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise _PastTheEnd(end, "metadata")
        return super()._get(offset, dtype, count, override_order)

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        end = max((start_offs + _tensor_extent(field) for field in fields), default=start_offs)
        if end > len(self.data):
            raise _PastTheEnd(end, "tensor data")
        super()._build_tensors(start_offs, fields)


def _tensor_extent(field: Any) -> int:
    """Where a tensor's data ends, from the data's start (its info field: name length, name,
    number of dimensions, dimensions, type, offset, as the reader reads it)."""
    _, _, _, dims, raw_type, offset = field.parts
    try:
        block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
    except ValueError as e:
        raise ValueError(f"tensor type {int(raw_type[0])} is unknown") from e
    elements = 1
    for n in dims.tolist():
        elements *= int(n)
    return int(offset[0]) + elements * type_size // block_size
