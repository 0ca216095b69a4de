"""The shipped demo checkpoints: standard Hugging Face Llama directories that tokenmill and
transformers load and decode identically, small enough to ship in the package."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill import LLM, SamplingParams
from tokenmill.demo import WEIGHTS_DIR, demo_model_path
from tokenmill.demo.corpus import chat_prompt

MAX_TOKENS = 24
MAX_SHIPPED_BYTES = 50 * 1024**2
CHAT_PROMPTS = [
    "Reverse this list: apple banana cherry dog",
    "What is 23 + 58?",
    "Sort these numbers: 42 7 19 3 88",
    "Repeat this text exactly:\nOne day, Tom lost his red ball.",
    "Here is a list of codes.\n- Tormi: 311\n- Kelsol: 845\n- Dravin: 207\n"
    "What is the code for Kelsol?",
]
STORY_PROMPT = "Once upon a time,"


@pytest.fixture(scope="module", params=["target", "draft"])
def model_dir(request) -> Path:
    return demo_model_path(request.param)


def test_demo_model_path_names_only_shipped_models() -> None:
    assert demo_model_path() == WEIGHTS_DIR / "target"
    with pytest.raises(ValueError, match="unknown demo model"):
        demo_model_path("huge")


def test_shipped_weights_stay_small() -> None:
    total = sum(p.stat().st_size for p in WEIGHTS_DIR.rglob("*") if p.is_file())
    assert total < MAX_SHIPPED_BYTES


def test_checkpoint_is_a_standard_llama_with_gqa(model_dir: Path) -> None:
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= names
    assert {"tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]


def test_draft_is_much_smaller_than_target() -> None:
    sizes = {
        name: (demo_model_path(name) / "model.safetensors").stat().st_size
        for name in ("target", "draft")
    }
    assert sizes["draft"] * 2.5 < sizes["target"]


def _prompt_ids(tokenizer) -> list[list[int]]:
    chats = [tokenizer.encode(chat_prompt(p), add_special_tokens=False) for p in CHAT_PROMPTS]
    return [*chats, tokenizer.encode(STORY_PROMPT)]


def test_greedy_output_equals_transformers_token_for_token(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = _prompt_ids(tokenizer)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = reference.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False
            )
            expected.append(out[0, len(ids) :].tolist())
    llm = LLM(model=str(model_dir), dtype="float32")
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    # Chat replies stop at <|im_end|>, as generation_config.json says, in both.
    assert any(len(e) < MAX_TOKENS for e in expected[: len(CHAT_PROMPTS)])
