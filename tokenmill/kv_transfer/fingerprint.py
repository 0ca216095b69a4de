"""What KV computed by one engine is valid for: the same model, compute dtype and KV layout.
Stored blocks live under `model_fingerprint`, so another model's never match; engines that
hand KV to each other must agree on `transfer_fingerprint`."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenmill.layers.kv_cache import KVCacheSpec

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def model_fingerprint(model_dir: Path, compute_dtype: str, kv_cache_spec: KVCacheSpec) -> str:
    """SHA-256 over the model's path and files (their modification times too: a checkpoint
    rewritten in place gets a new fingerprint), the compute dtype and the KV cache layout."""
    model_dir = Path(model_dir).resolve()
    return _fingerprint(model_dir, compute_dtype, kv_cache_spec, str(model_dir), with_times=True)


def transfer_fingerprint(model_dir: Path, compute_dtype: str, kv_cache_spec: KVCacheSpec) -> str:
    """As `model_fingerprint` but without what differs between two machines holding copies of
    the same checkpoint (its path, the files' modification times)."""
    return _fingerprint(Path(model_dir).resolve(), compute_dtype, kv_cache_spec, "", False)


def _fingerprint(
    model_dir: Path, compute_dtype: str, spec: KVCacheSpec, prefix: str, with_times: bool
) -> str:
    """SHA-256 over `prefix`, config.json, the weight files' names and sizes (and
    modification times), the compute dtype and the KV cache layout."""
    digest = hashlib.sha256(prefix.encode())
    config = model_dir / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for path in sorted(model_dir.iterdir()):
        if path.suffix in _WEIGHT_SUFFIXES and path.is_file():
            stat = path.stat()
            mtime = f":{stat.st_mtime_ns}" if with_times else ""
            digest.update(f"{path.name}:{stat.st_size}{mtime};".encode())
    digest.update(
        f"{compute_dtype}|{spec.num_layers}|{spec.block_size}|{spec.num_kv_heads}|"
        f"{spec.head_dim}|{spec.dtype}".encode()
    )
    return digest.hexdigest()
