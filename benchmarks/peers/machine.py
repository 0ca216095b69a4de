"""What benchmarks/peers records about the machine and the weights: `lscpu`'s model and
flags, the read bandwidth (the roof), a process tree's resident memory, and the weight bytes a
decode step reads.

Standard library only at the top (gguf is imported where needed).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

# Flags that decide which kernels a CPU runs (prefixes of lscpu's names).
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx")

# torch.sum over 256 MiB of float32, best of 5: a streaming read of the whole tensor.
_BANDWIDTH = """
import time, torch
x = torch.ones(64 * 1024 * 1024)
best = float("inf")
for _ in range(6):
    start = time.perf_counter(); torch.sum(x); best = min(best, time.perf_counter() - start)
print(x.numel() * 4 / best / 1e9)
"""

_SAFETENSORS_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip


def lscpu_summary() -> tuple[str, str]:
    """(model name, family, model and vCPUs; the kernel-relevant flags)."""
    fields = {}
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    model = f"{fields.get('Model name', '?')} family {fields.get('CPU family', '?')} model "
    model += f"{fields.get('Model', '?')}, {os.cpu_count()} vCPU"
    flags = [f for f in fields.get("Flags", "").split() if f.startswith(KERNEL_FLAGS)]
    return model, " ".join(flags)


def read_bandwidth_gbs(python: str = sys.executable) -> float:
    """GB/s of a streaming read (torch.sum over 256 MiB, all threads, best of 5 after one
    warm-up), in a child process so that this one never loads torch."""
    result = subprocess.run([python, "-c", _BANDWIDTH], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"bandwidth probe failed:\n{result.stderr[-2000:]}")
    return float(result.stdout.split()[-1])


def safetensors_weight_bytes(checkpoint: Path, float_bytes: int) -> int:
    """Bytes of a Hugging Face checkpoint's tensors with floating-point ones counted at
    `float_bytes` each (the engine's compute dtype) and integer ones (quantized weights) as
    stored. A tied LM head is the embedding, stored and counted once: a decode step reads it
    once, as the LM head (the embedding lookup reads one row)."""
    total = 0
    for file in sorted(checkpoint.glob("*.safetensors")):
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                count *= dim
            dtype = entry["dtype"]
            is_float = dtype.startswith(("F", "BF")) and not dtype.startswith("F8")
            total += count * (float_bytes if is_float else _SAFETENSORS_BYTES[dtype])
    return total


def gguf_tensor_types(path: Path) -> tuple[int, dict[str, int]]:
    """(bytes of a GGUF file's tensors, how many tensors of each GGML type)."""
    import gguf

    reader = gguf.GGUFReader(path)
    types: dict[str, int] = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    return sum(int(t.n_bytes) for t in reader.tensors), types


def weight_bytes(weights: Path, float_bytes: int) -> int:
    """What one decode step reads: a GGUF file's tensors as stored, or a checkpoint's with
    its float tensors at `float_bytes`."""
    if weights.suffix == ".gguf":
        return gguf_tensor_types(weights)[0]
    return safetensors_weight_bytes(weights, float_bytes)
