"""`tokenmill bench make-model`: a random Llama of a preset's shape, built once, that the
engine serves; the same preset twice gives the same files."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.bench import random_model
from tokenmill.bench.random_model import Preset
from tokenmill.entrypoints.cli import main

TINY = Preset(
    "test-tiny-v1",
    dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
         intermediate_size=128, vocab_size=4096, tie_word_embeddings=True),
)  # fmt: skip


def digest(directory: Path) -> str:
    return hashlib.sha256(
        b"".join(f.read_bytes() for f in sorted(directory.iterdir()) if f.is_file())
    ).hexdigest()


def test_make_model_writes_a_preset_the_engine_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setitem(random_model.PRESETS, "tiny", TINY)
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "make-model", "--preset", "tiny"]) == 0
    built = Path(capsys.readouterr().out.strip())
    assert built == tmp_path / "cache" / TINY.name
    llm = LLM(model=str(built), dtype="float32", max_model_len=128)
    assert llm.engine.vocab_size == 4096  # the shape's, beyond the 2048-token tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate([[1, 3000, 17, 900]], params)
    assert len(out[0].outputs[0].token_ids) == 4
    again = random_model.make_random_model(TINY.name, TINY.shape, tmp_path / "again")
    assert digest(again) == digest(built)  # deterministic


def test_an_unknown_preset_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "make-model", "--preset", "nope"])
    assert "invalid choice" in capsys.readouterr().err


def test_an_moe_preset_builds_its_architecture_in_its_dtype(tmp_path: Path) -> None:
    """The `qwen3-moe` preset's recipe at a tiny size: a Qwen3-MoE checkpoint in bfloat16
    (built in that dtype) that the engine serves with MoE blocks."""
    shape = {**random_model.PRESETS["qwen3-moe"].shape}
    shape.update(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 num_hidden_layers=2, vocab_size=4096)  # fmt: skip
    built = random_model.make_random_model("test-tiny-moe-v1", shape, tmp_path / "moe")
    # dtype named: "auto" serves bfloat16 checkpoints in float32 where the CPU has no native
    # bf16 products (AVX2 without AVX512_BF16); this checks the checkpoint's own dtype.
    llm = LLM(model=str(built), max_model_len=128, dtype="bfloat16")
    model = llm.engine.runner.model
    assert model.architecture == "Qwen3MoeForCausalLM"
    assert type(model.layers[0].mlp).__name__ == "FusedMoE"
    assert model.layers[0].mlp.experts[0].gate_up_proj.quant_method.weight_format == "bfloat16"
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[1, 3000, 17, 900]], params)[0].outputs[0].token_ids) == 4
