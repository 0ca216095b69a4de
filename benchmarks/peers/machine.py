"""What benchmarks/peers records about the machine and the weights: `lscpu`'s model and
flags, the read bandwidth (the roof), a process tree's resident memory, the weight bytes a
checkpoint holds and those a batch-1 decode step reads (the active bytes: a mixture of experts'
routed experts count k of E, an untied embedding table one row).

Standard library only at the top (gguf is imported where needed).
"""

from __future__ import annotations

import json
import os
import re
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
    return sum(_safetensors_tensors(checkpoint, float_bytes).values())


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


# A routed expert's tensor (Hugging Face: `mlp.experts.3.down_proj`, stacked `mlp.experts.
# gate_up_proj`, Mixtral's `block_sparse_moe.experts.0.w1`; GGUF: `blk.0.ffn_down_exps`), not a
# shared expert's (`shared_expert.`, `ffn_down_shexp`): every token reads all of those.
_ROUTED_EXPERT = re.compile(r"\.experts\.|_exps\.")
# The input embedding's table: a step reads one row of it, unless it is also the LM head.
_EMBEDDING = ("model.embed_tokens.weight", "token_embd.weight")
_LM_HEAD = ("lm_head.weight", "output.weight")


def active_share(name: str, experts: tuple[int, int] | None) -> float:
    """The share of tensor `name` a batch-1 step reads: k / E for a routed expert's (`experts`:
    (k, E)), all of any other."""
    if experts is None or not _ROUTED_EXPERT.search(name):
        return 1.0
    return experts[0] / experts[1]


def step_bytes(weights: Path, float_bytes: int) -> int:
    """The active bytes of one decode step at B = 1 (issue 43's roof): attention, dense MLPs,
    shared experts, norms, the router, k of E routed experts and the LM head, as the weights
    store them (a checkpoint's float tensors at `float_bytes`); an untied input embedding is
    left out (a step reads one row of it), a tied one is the LM head and counted."""
    if weights.suffix == ".gguf":
        sizes, experts = _gguf_tensors(weights)
    else:
        sizes, experts = _safetensors_tensors(weights, float_bytes), _config_experts(weights)
    untied = any(name in sizes for name in _LM_HEAD)
    return round(
        sum(
            size * active_share(name, experts)
            for name, size in sizes.items()
            if not (untied and name in _EMBEDDING)
        )
    )


def _safetensors_tensors(checkpoint: Path, float_bytes: int) -> dict[str, int]:
    sizes = {}
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
            sizes[name] = count * (float_bytes if is_float else _SAFETENSORS_BYTES[dtype])
    return sizes


def _config_experts(checkpoint: Path) -> tuple[int, int] | None:
    """(k, E) from config.json (E: `num_experts` or Mixtral's / gpt-oss's `num_local_experts`),
    or None for a dense model."""
    path = checkpoint / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    config = config.get("text_config", config)
    total = config.get("num_experts") or config.get("num_local_experts")
    active = config.get("num_experts_per_tok")
    return (int(active), int(total)) if total and active else None


def _gguf_tensors(path: Path) -> tuple[dict[str, int], tuple[int, int] | None]:
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"]
    arch_name = bytes(arch.parts[arch.data[0]]).decode()
    counts = []
    for key in (f"{arch_name}.expert_used_count", f"{arch_name}.expert_count"):
        field = reader.fields.get(key)
        counts.append(None if field is None else int(field.parts[field.data[0]][0]))
    experts = (counts[0], counts[1]) if counts[0] and counts[1] else None
    return {t.name: int(t.n_bytes) for t in reader.tensors}, experts
