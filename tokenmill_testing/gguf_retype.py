"""A GGUF file rewritten with some tensors in other GGML types (the gguf package's writer): the
metadata copied as it is, each float tensor that `wanted(name, shape)` names encoded in that
type. For architectures whose checkpoints the converter writes (Qwen3.5's `qwen35`) where
`llama-quantize` is not built; also the dequantized twin of a quantized file (`dequantized`),
the float reference a quantized engine is held to."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from tokenmill_testing.gguf_checkpoint import encode

_FLOATS = (Q.F32, Q.F16, Q.BF16)


def retyped(source: Path, out: Path, wanted: Callable[[str, tuple[int, ...]], Q | None]) -> Path:
    """`source` at `out` with each tensor `wanted` gives a type (shape rows first) in that
    type: encoded from its float values, or F32 (dequantized); the others as they are."""
    reader = gguf.GGUFReader(str(source))
    architecture = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out), architecture)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))
        qtype = Q(tensor.tensor_type)
        target = wanted(tensor.name, shape)
        data = np.asarray(tensor.data)
        if target is None or target == qtype:
            writer.add_tensor(tensor.name, data, raw_dtype=qtype)
            continue
        values = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(shape)
        if target == Q.F32:
            writer.add_tensor(tensor.name, values)
        else:
            writer.add_tensor(tensor.name, encode(values, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def dequantized(source: Path, out: Path) -> Path:
    """`source` with every quantized tensor as F32: what it holds, as floats."""
    reader = gguf.GGUFReader(str(source))
    quantized = {t.name for t in reader.tensors if Q(t.tensor_type) not in _FLOATS}
    return retyped(source, out, lambda name, shape: Q.F32 if name in quantized else None)
