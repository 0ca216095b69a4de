"""Loading real checkpoint layouts, and clear errors for the broken ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError
from tokenmill.models.loader import ModelLoadError


def copy_checkpoint(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def greedy_ids(model_dir: Path) -> list[int]:
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return llm.generate([[5, 9, 13, 200]], params, use_tqdm=False)[0].outputs[0].token_ids


def test_sharded_checkpoint_gives_the_same_output(tiny_checkpoint) -> None:
    single = tiny_checkpoint("qwen2")
    sharded = tiny_checkpoint("qwen2", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert greedy_ids(sharded) == greedy_ids(single)


def test_missing_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        LLM(model=str(tmp_path))


def test_unknown_architecture_is_named(tiny_checkpoint, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        LLM(model=str(model_dir))


def test_missing_tensor_is_named(tiny_checkpoint, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "m")
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.1\.self_attn\.qkv_proj"):
        LLM(model=str(model_dir))


def test_wrong_tensor_shape_is_named(tiny_checkpoint, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "m")
    weights = load_file(model_dir / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1].clone()
    save_file(weights, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight"):
        LLM(model=str(model_dir))


def test_no_weights_is_named(tiny_checkpoint, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        LLM(model=str(model_dir))


def test_kv_budget_too_small_for_one_sequence_is_a_config_error(tiny_checkpoint) -> None:
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(model=str(tiny_checkpoint("llama")), num_kv_blocks=2, max_model_len=256)


def test_unknown_engine_argument_is_rejected(tiny_checkpoint) -> None:
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(model=str(tiny_checkpoint("llama")), max_num_seq=4)


def test_unchunked_prefill_needs_a_budget_for_the_longest_prompt(tiny_checkpoint) -> None:
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        LLM(
            model=str(tiny_checkpoint("llama")),
            enable_chunked_prefill=False,
            max_num_batched_tokens=64,
            max_model_len=128,
        )


def test_linear_backends_give_the_same_greedy_output(tiny_checkpoint) -> None:
    """On the CPU in float32 the default packs linear weights for the native kernels (oneDNN's
    layout without them); torch's F.linear must generate the same tokens."""
    from tokenmill.layers.linear import cpu_dense_method

    checkpoint = str(tiny_checkpoint("qwen3"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for backend in ("auto", "torch"):
        llm = LLM(model=checkpoint, dtype="float32", max_model_len=64, linear_backend=backend)
        lm_head = llm.engine.runner.model.lm_head
        fast = cpu_dense_method(torch.float32)
        assert isinstance(lm_head.quant_method, type(fast)) == (
            backend == "auto" and fast is not None
        )
        outputs[backend] = llm.generate([[5, 9, 13, 200]], params, use_tqdm=False)[0]
    assert outputs["auto"].outputs[0].token_ids == outputs["torch"].outputs[0].token_ids


def load_error(model_dir: Path) -> str:
    with pytest.raises(ModelLoadError) as error:
        LLM(model=str(model_dir), max_model_len=64)
    message = str(error.value)
    assert "\n" not in message
    return message


def test_missing_tokenizer_is_one_clear_line(tiny_checkpoint, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "m")
    for path in model_dir.glob("*"):
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            path.unlink()
    message = load_error(model_dir)
    assert message.startswith(f"{model_dir} has no tokenizer files")
    assert "--tokenizer" in message and "sentencepiece" not in message


def test_truncated_weights_are_one_clear_line(tiny_checkpoint, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "m")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    message = load_error(model_dir)
    assert message.startswith(f"{weights} is not a complete safetensors file")
    assert "truncated" in message
