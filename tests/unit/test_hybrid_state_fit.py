"""A hybrid model's state slots under the CPU default KV budget: max_num_seqs is lowered so
that the states leave room for KV blocks; an explicit budget is kept as given; a budget sized
before loading (the peers benchmark's memory probe) counts one sequence's state."""

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import DEFAULT_CPU_KV_CACHE_BYTES, ConfigError, EngineConfig
from tokenmill.engine.hybrid import fit_state_slots, probe_state_bytes

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


def test_memory_probe_budget_holds_one_sequence_state(tiny_checkpoint) -> None:
    """benchmarks/peers' memory probe (one sequence, a KV budget of a few blocks): a budget
    below the state leaves no KV blocks, as the probe's fixed 4 MiB did for Qwen3.5-0.8B's
    19 MiB; `probe_state_bytes` on top of it (read from the checkpoint before loading, the
    engine's own slot size) loads and generates."""
    dims = {"linear_key_head_dim": 32, "linear_value_head_dim": 32}
    heads = {"linear_num_key_heads": 2, "linear_num_value_heads": 8}
    checkpoint = str(tiny_checkpoint("qwen3_5", num_hidden_layers=4, **heads, **dims))
    state = probe_state_bytes(checkpoint)
    assert state == 3 * (8 * 32 * 32 * 4 + 3 * (2 * 64 + 256) * 4)  # 3 linear layers, f32
    kv = state // 4
    probe = {"dtype": "float32", "max_num_seqs": 1, "max_model_len": 64}
    with pytest.raises(ConfigError, match="leaves no KV blocks"):
        LLM(model=checkpoint, kv_cache_memory=kv, enable_prefix_caching=False, **probe)
    llm = LLM(model=checkpoint, kv_cache_memory=kv + state, enable_prefix_caching=False, **probe)
    assert llm.engine.runner.model.state_spec.bytes_per_slot == state
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    assert probe_state_bytes(tiny_checkpoint("llama")) == 0  # a dense model: nothing beside KV
