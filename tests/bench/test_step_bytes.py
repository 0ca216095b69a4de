"""benchmarks/peers/machine.py's active bytes of a decode step (the roofline's numerator, issue
43's roof): k of E routed experts, shared experts whole, an untied embedding left out and a
tied one counted as the LM head; from a checkpoint's header and config and from a GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from benchmarks.peers import machine

# name -> elements: one layer of a Qwen2-MoE-like model, 4 experts, 2 active
ATTENTION = {
    "model.layers.0.self_attn.qkv_proj.weight": 96,
    "model.layers.0.input_layernorm.weight": 8,
}
EXPERTS = {
    f"model.layers.0.mlp.experts.{e}.{p}.weight": 40
    for e in range(4)
    for p in ("up_proj", "down_proj")
}
SHARED = {
    "model.layers.0.mlp.shared_expert.up_proj.weight": 24,
    "model.layers.0.mlp.gate.weight": 16,
}
EMBEDDING, LM_HEAD = {"model.embed_tokens.weight": 200}, {"lm_head.weight": 200}


def checkpoint(tmp_path: Path, tied: bool, config: dict) -> Path:
    names = {**ATTENTION, **EXPERTS, **SHARED, **EMBEDDING, **({} if tied else LM_HEAD)}
    save_file({n: torch.zeros(count, dtype=torch.bfloat16) for n, count in names.items()},
              tmp_path / "model.safetensors")  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("tied", [False, True])
def test_a_step_reads_k_of_e_experts_and_the_lm_head(tmp_path: Path, tied: bool) -> None:
    path = checkpoint(tmp_path, tied, {"num_experts": 4, "num_experts_per_tok": 2})
    dense = sum(ATTENTION.values()) + sum(SHARED.values())
    # tied: the embedding is the LM head, read whole; untied: the LM head, not the embedding
    expected = dense + sum(EXPERTS.values()) // 2 + 200
    assert machine.step_bytes(path, 2) == 2 * expected
    assert machine.step_bytes(path, 4) == 4 * expected
    stored = dense + sum(EXPERTS.values()) + 200 * (1 if tied else 2)
    assert machine.weight_bytes(path, 2) == 2 * stored  # what the checkpoint holds, unchanged


def test_a_dense_config_counts_every_expert_named_tensor(tmp_path: Path) -> None:
    """No expert counts in config.json: nothing is routed, every tensor is read."""
    path = checkpoint(tmp_path, False, {"hidden_size": 8})
    expected = sum(ATTENTION.values()) + sum(EXPERTS.values()) + sum(SHARED.values()) + 200
    assert machine.step_bytes(path, 2) == 2 * expected


def test_a_gguf_reads_k_of_e_of_its_exps_tensors(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "moe.gguf"
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    tensors = {
        "token_embd.weight": np.zeros((10, 16), dtype=np.float32),
        "output.weight": np.zeros((10, 16), dtype=np.float32),
        "blk.0.attn_q.weight": np.zeros((16, 16), dtype=np.float32),
        "blk.0.ffn_gate_inp.weight": np.zeros((8, 16), dtype=np.float32),
        "blk.0.ffn_up_exps.weight": np.zeros((8, 4, 16), dtype=np.float32),
        "blk.0.ffn_up_shexp.weight": np.zeros((4, 16), dtype=np.float32),
    }
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # output + attn_q + router + 2 of 8 experts + shared; the untied embedding left out
    expected = 4 * (160 + 256 + 128 + 2 * 64 + 64)
    assert machine.step_bytes(path, 2) == expected
