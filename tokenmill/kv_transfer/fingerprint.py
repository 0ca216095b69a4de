"""What KV saved by one engine is valid for: the same model files, compute dtype and KV
layout. Stored blocks live under this fingerprint, so another model's never match."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenmill.layers.kv_cache import KVCacheSpec

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def model_fingerprint(model_dir: Path, compute_dtype: str, kv_cache_spec: KVCacheSpec) -> str:
    """SHA-256 over the model's config, its weight files' names, sizes and modification
    times (a checkpoint rewritten in place gets a new fingerprint), the compute dtype and the
    KV cache layout."""
    digest = hashlib.sha256()
    model_dir = Path(model_dir).resolve()
    digest.update(str(model_dir).encode())
    config = model_dir / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(model_dir.iterdir()):
        if path.suffix in _WEIGHT_SUFFIXES and path.is_file():
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    spec = kv_cache_spec
    digest.update(
        f"{compute_dtype}|{spec.num_layers}|{spec.block_size}|{spec.num_kv_heads}|"
        f"{spec.head_dim}|{spec.dtype}".encode()
    )
    return digest.hexdigest()
