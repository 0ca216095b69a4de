"""A hybrid model's state slots under the CPU default KV budget: max_num_seqs is lowered so
that the states leave room for KV blocks; an explicit budget is kept as given."""

import torch

from tokenmill.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from tokenmill.engine.hybrid import fit_state_slots

CPU = torch.device("cpu")
QWEN35_SLOT = 20 * 2**20  # about a real Qwen3.5-0.8B's conv + recurrent state per sequence


def test_default_budget_lowers_max_num_seqs_to_what_fits() -> None:
    config = EngineConfig(max_num_seqs=256, enable_prefix_caching=True)
    fitted = fit_state_slots(config, QWEN35_SLOT, CPU)
    per_sequence = 2 * QWEN35_SLOT  # the running slot and its snapshot
    assert 1 <= fitted.max_num_seqs < 256
    assert fitted.max_num_seqs * per_sequence <= DEFAULT_CPU_KV_CACHE_BYTES // 2
    assert config.max_num_seqs == 256  # the caller's config is not changed


def test_small_states_and_explicit_budgets_keep_max_num_seqs() -> None:
    config = EngineConfig(max_num_seqs=256)
    assert fit_state_slots(config, 4096, CPU).max_num_seqs == 256
    given = EngineConfig(max_num_seqs=256, kv_cache_memory=2**30)
    assert fit_state_slots(given, QWEN35_SLOT, CPU).max_num_seqs == 256
