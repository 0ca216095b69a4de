"""A hybrid model's state slots under the CPU default KV budget: max_num_seqs is lowered so
that the states leave room for KV blocks; an explicit budget is kept as given; a budget sized
given in blocks (the peers benchmark's memory probe) keeps its blocks, the state beside them."""

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import DEFAULT_CPU_KV_CACHE_BYTES, ConfigError, EngineConfig
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


def test_memory_probe_in_blocks_holds_one_sequence_and_its_state(tiny_checkpoint) -> None:
    """benchmarks/peers' memory probe (one sequence, num_kv_blocks for 64 tokens): a byte budget
    below the state leaves no KV blocks, as the probe's old fixed 4 MiB did for Qwen3.5-0.8B's
    19 MiB; the same cache given in blocks keeps them, the state in a slot of its own beside."""
    dims = {"linear_key_head_dim": 32, "linear_value_head_dim": 32}
    heads = {"linear_num_key_heads": 2, "linear_num_value_heads": 8}
    checkpoint = str(tiny_checkpoint("qwen3_5", num_hidden_layers=4, **heads, **dims))
    # One state slot (no snapshots), as the peers probe runs.
    probe = {
        "dtype": "float32",
        "max_num_seqs": 1,
        "max_model_len": 64,
        "enable_prefix_caching": False,
    }
    state = 3 * (8 * 32 * 32 * 4 + 3 * (2 * 64 + 256) * 4)  # 3 linear layers, f32
    with pytest.raises(ConfigError, match="leaves no KV blocks"):
        LLM(model=checkpoint, kv_cache_memory=state // 4, **probe)
    llm = LLM(model=checkpoint, num_kv_blocks=4, **probe)
    assert llm.engine.runner.model.state_spec.bytes_per_slot == state
    assert llm.get_stats().scheduler.num_kv_blocks == 4
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    output = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 60  # 64 tokens: the four blocks
