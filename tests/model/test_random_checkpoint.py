"""Random checkpoints must be real, loadable Hugging Face checkpoints with useful logits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from tokenmill_testing import random_checkpoint as rc

ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
TEXTS = [
    "The cat reads a long letter in the morning.",
    "def get_value(x, y):\n    return x * 42 + y\n",
    "Café crème, Größe, año, 你好，世界。日本語 😀 🚀 👍🏽 Привет! α+β≤∞",
    "  leading spaces\tand\ttabs\r\n\nnew lines  ",
]
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def _logits(path: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    ids = tokenizer(TEXTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits[0]


def _file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.mark.parametrize("architecture", sorted(ARCH_CLASSES))
def test_architecture_loads_with_spread_logits(
    tiny_checkpoint: Callable[..., Path], architecture: str
) -> None:
    path = tiny_checkpoint(architecture)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert type(model).__name__ == ARCH_CLASSES[architecture]
    assert model.config.vocab_size == 1024
    logits = _logits(path)
    assert logits.shape[-1] == 1024
    std = logits.std(dim=-1)
    assert torch.all((std > 2.0) & (std < 8.0)), std
    # Not near-uniform: the top token clearly stands out on average.
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).mean() > 0.3
    # Different positions prefer different tokens (attention/RoPE actually matter).
    assert len(set(logits.argmax(dim=-1).tolist())) > 3


def test_architecture_specific_weights(tiny_checkpoint: Callable[..., Path]) -> None:
    qwen2 = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen2"))
    attn = qwen2.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.q_proj.bias.abs().sum() > 0
    qwen3 = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3"))
    norm = qwen3.model.layers[0].self_attn.q_norm.weight
    assert norm.shape == (16,) and not torch.allclose(norm, torch.ones_like(norm))
    assert qwen3.config.head_dim == 16  # not Qwen3Config's default of 128
    mistral = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("mistral"))
    assert mistral.config.sliding_window is None
    llama = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"))
    assert llama.model.layers[0].self_attn.q_proj.bias is None


def test_config_overrides_and_tied_embeddings(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint(
        "mistral", sliding_window=8, tie_word_embeddings=True, head_dim=32, rope_theta=500.0
    )
    config = json.loads((path / "config.json").read_text())
    assert config["sliding_window"] == 8
    assert config["head_dim"] == 32
    assert config["rope_parameters"]["rope_theta"] == 500.0
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    std = _logits(path).std(dim=-1)
    assert torch.all((std > 2.0) & (std < 8.0)), std


def test_sharded_save_has_index_and_same_weights(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    sharded = tiny_checkpoint("qwen2", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = set(index["weight_map"].values())
    assert len(shard_files) > 1
    assert all((sharded / name).is_file() for name in shard_files)
    assert not (sharded / "model.safetensors").exists()
    assert torch.equal(_logits(sharded), _logits(tiny_checkpoint("qwen2")))


def test_same_arguments_give_identical_files(tmp_path: Path, tokenizer_dir: Path) -> None:
    first = rc.save_random_checkpoint(tmp_path / "a", "qwen3", tokenizer_dir=tokenizer_dir)
    second = rc.save_random_checkpoint(tmp_path / "b", "qwen3", tokenizer_dir=tokenizer_dir)
    other_seed = rc.save_random_checkpoint(
        tmp_path / "c", "qwen3", tokenizer_dir=tokenizer_dir, seed=1
    )
    assert _file_bytes(first) == _file_bytes(second)
    assert (first / "model.safetensors").read_bytes() != (
        other_seed / "model.safetensors"
    ).read_bytes()


def test_global_rng_is_left_alone(tmp_path: Path, tokenizer_dir: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    rc.save_random_checkpoint(tmp_path, "llama", tokenizer_dir=tokenizer_dir, seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_training_is_deterministic(tmp_path: Path) -> None:
    rc.train_tokenizer(tmp_path / "a")
    rc._trained_tokenizer_json.cache_clear()  # retrain for real
    rc.train_tokenizer(tmp_path / "b")
    assert _file_bytes(tmp_path / "a") == _file_bytes(tmp_path / "b")


def test_bf16_checkpoint(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama", dtype=torch.bfloat16)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_generation_config_names_eos(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    generation_config = transformers.GenerationConfig.from_pretrained(path)
    assert (
        generation_config.eos_token_id
        == tokenizer.eos_token_id
        == tokenizer.encode("</s>", add_special_tokens=False)[0]
    )


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips(tokenizer_dir: Path, text: str) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id  # Llama-3 style BOS on plain encodes
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(ids[1:]) == text


def test_multibyte_characters_span_several_tokens(tokenizer_dir: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    assert len(tokenizer) == 1024
    for char in ["界", "😀", "ж"]:
        ids = tokenizer.encode(char, add_special_tokens=False)
        assert len(ids) > 1, char
        assert "\ufffd" in tokenizer.decode(ids[:1])


def test_special_tokens(tokenizer_dir: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    tokens = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    assert len(set(ids)) == len(tokens) and max(ids) < len(tokenizer)
    assert [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token] == tokens[:3]
    # Special tokens in text become single tokens, and are skippable on decode.
    encoded = tokenizer.encode("<|im_start|>user", add_special_tokens=False)
    assert encoded[0] == ids[3]
    assert tokenizer.decode(encoded, skip_special_tokens=True) == "user"


@pytest.mark.parametrize("architecture", sorted(ARCH_CLASSES))
def test_auto_tokenizer_matches_tokenizer_json(
    tiny_checkpoint: Callable[..., Path], architecture: str
) -> None:
    # AutoTokenizer rebuilds qwen2 tokenizers as Qwen2Tokenizer from vocab + merges; it must
    # still agree with tokenizer.json and not grow the vocab.
    path = tiny_checkpoint(architecture)
    auto = AutoTokenizer.from_pretrained(path)
    plain = PreTrainedTokenizerFast.from_pretrained(path)
    assert len(auto) == len(plain) == 1024
    for text in TEXTS:
        assert auto.encode(text) == plain.encode(text)


def test_chat_template_renders_generation_prompt(tokenizer_dir: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi there"}]},
    ]
    with_prompt = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert with_prompt == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False)
    assert with_prompt.startswith(without) and not without.endswith("assistant\n")
    ids = tokenizer.encode(with_prompt, add_special_tokens=False)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    assert ids.count(tokenizer.bos_token_id) == 1


def test_llama3_rope_scaling_is_saved_and_used(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama", rope_scaling=LLAMA3_SCALING)
    rope = json.loads((path / "config.json").read_text())["rope_parameters"]
    assert rope == {**LLAMA3_SCALING, "rope_theta": 10000.0}
    scaled = AutoModelForCausalLM.from_pretrained(path).model.rotary_emb
    plain = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama")).model.rotary_emb
    assert scaled.rope_type == "llama3"
    # High frequencies are kept, the lowest ones are divided by the factor.
    assert torch.allclose(scaled.inv_freq[:2], plain.inv_freq[:2])
    assert torch.allclose(scaled.inv_freq[-1], plain.inv_freq[-1] / 8.0)
    assert not torch.equal(_logits(path)[-1], _logits(tiny_checkpoint("llama"))[-1])


def test_unknown_architecture_is_rejected(tmp_path: Path, tokenizer_dir: Path) -> None:
    with pytest.raises(ValueError, match="unknown architecture"):
        rc.save_random_checkpoint(tmp_path, "gpt2", tokenizer_dir=tokenizer_dir)
