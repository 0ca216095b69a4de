"""The KV cache's default size on the CPU (from the limits served, the cap and the memory
available, with the reason said) and its host allocation (resident only as it is used)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import DEFAULT_CPU_KV_CACHE_BYTES, ConfigError, EngineConfig
from tokenmill.core.kv import sizing
from tokenmill.core.kv.sizing import kv_cache_size
from tokenmill.layers.kv_cache import KVCacheSpec

CPU = torch.device("cpu")
# SmolLM-135M's shape: 30 layers, 3 KV heads of 64, bfloat16: 720 KiB per 16-token block.
SPEC = KVCacheSpec(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_the_cpu_default_is_what_the_served_limits_can_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sizing, "available_memory_bytes", lambda: 64 * 1024**3)
    size = kv_cache_size(EngineConfig(max_num_seqs=4), SPEC, 512, CPU)
    assert size.num_blocks == 4 * 512 // 16
    assert "max_num_seqs x max_model_len = 4 x 512 tokens" in size.reason
    assert size.reason.startswith("CPU default: max_num_seqs")


def test_the_cpu_default_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing, "available_memory_bytes", lambda: 64 * 1024**3)
    size = kv_cache_size(EngineConfig(max_num_seqs=256), SPEC, 2048, CPU)
    assert size.num_blocks == DEFAULT_CPU_KV_CACHE_BYTES // SPEC.bytes_per_block
    assert size.reason.startswith("CPU default: the cap of 2.00 GiB")


def test_the_cpu_default_takes_at_most_half_the_memory_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sizing, "available_memory_bytes", lambda: 1024**3)
    size = kv_cache_size(EngineConfig(max_num_seqs=256), SPEC, 2048, CPU)
    assert size.num_blocks == (1024**3 // 2) // SPEC.bytes_per_block
    assert size.reason.startswith("CPU default: half the 1.00 GiB available")
    monkeypatch.setattr(sizing, "available_memory_bytes", lambda: 10 * 1024**2)
    with pytest.raises(ConfigError, match=r"half the 0\.01 GiB available"):
        kv_cache_size(EngineConfig(), SPEC, 2048, CPU)


def test_a_given_size_is_taken_as_given() -> None:
    assert kv_cache_size(EngineConfig(num_kv_blocks=300), SPEC, 2048, CPU).num_blocks == 300
    given = kv_cache_size(EngineConfig(kv_cache_memory=3 * 1024**3), SPEC, 2048, CPU)
    assert given.num_blocks == 3 * 1024**3 // SPEC.bytes_per_block
    assert "kv_cache_memory 3.00 GiB given" in given.reason


def test_a_host_kv_cache_is_zeroed_and_resident_only_where_written() -> None:
    before = _resident_bytes()
    caches = SPEC.allocate(728, CPU)  # 512 MiB over 30 layers
    assert sum(c.numel() * c.element_size() for c in caches) == 728 * SPEC.bytes_per_block
    assert _resident_bytes() - before < 64 * 1024**2
    for cache in caches:  # one request's worth: the first two blocks of every layer
        cache[:, :2] = 1.0
    assert _resident_bytes() - before < 64 * 1024**2
    layer = caches[7]
    assert layer.shape == (2, 728, 16, 3, 64) and layer.dtype == torch.bfloat16
    assert torch.count_nonzero(layer[:, 2:]) == 0 and torch.all(layer[:, :2] == 1)
