"""What a tensor-parallel rank holds: heads, KV heads (split or replicated), vocabulary rows;
and the settings tensor parallelism refuses."""

from __future__ import annotations

import pytest

from tokenmill.config import ConfigError, EngineConfig, SpeculativeConfig
from tokenmill.layers.parallel import TensorParallel


def ranks(size: int) -> list[TensorParallel]:
    return [TensorParallel(rank=r, size=size) for r in range(size)]


def test_kv_heads_are_split_when_ranks_divide_them() -> None:
    assert [tp.kv_heads(4) for tp in ranks(2)] == [(2, 0), (2, 2)]


def test_kv_heads_are_replicated_when_ranks_outnumber_them() -> None:
    assert [tp.kv_heads(2) for tp in ranks(4)] == [(1, 0), (1, 0), (1, 1), (1, 1)]


@pytest.mark.parametrize(("size", "num_kv_heads"), [(3, 2), (3, 4)])
def test_kv_heads_that_do_not_divide_are_refused(size: int, num_kv_heads: int) -> None:
    with pytest.raises(ValueError, match=f"tensor_parallel_size={size}"):
        TensorParallel(rank=0, size=size).kv_heads(num_kv_heads)


def test_heads_that_do_not_divide_are_refused() -> None:
    with pytest.raises(ValueError, match="number of attention heads"):
        TensorParallel(rank=0, size=2).split(9, "number of attention heads")


def test_the_vocabulary_is_cut_into_equal_padded_ranges() -> None:
    assert [tp.vocab_range(1021) for tp in ranks(2)] == [(0, 511), (511, 511)]
    assert [tp.vocab_range(1024) for tp in ranks(2)] == [(0, 512), (512, 512)]


def test_settings_tensor_parallelism_cannot_take_are_refused() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="distributed_timeout"):
        EngineConfig(distributed_timeout=0)
    draft = SpeculativeConfig.parse({"method": "draft_model", "model": "x"})
    with pytest.raises(ConfigError, match="only ngram and suffix speculation"):
        EngineConfig(tensor_parallel_size=2, speculative_config=draft)
    suffix = SpeculativeConfig.parse({"method": "suffix"})  # no model: a copy on each rank
    assert EngineConfig(tensor_parallel_size=2, speculative_config=suffix).speculative_config
    with pytest.raises(ConfigError, match="enforce_eager"):
        EngineConfig(tensor_parallel_size=2, enforce_eager=False)
