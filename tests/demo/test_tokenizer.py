"""The shipped tokenizer: chat template round trip, and prompts that tokenize as trained."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from demo_training.config import VOCAB_SIZE
from tokenmill.demo import demo_model_path
from tokenmill.demo.corpus import chat_prompt, heldout_examples, render
from tokenmill.demo.eval import heldout


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_model_path("target"))


def test_target_and_draft_share_one_tokenizer() -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        target = (demo_model_path("target") / name).read_bytes()
        assert target == (demo_model_path("draft") / name).read_bytes()


def test_chat_template_lives_in_tokenizer_config(tokenizer) -> None:
    config = json.loads((demo_model_path("target") / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    assert len(tokenizer) == VOCAB_SIZE


@pytest.mark.parametrize("system", [None, "You are a helpful assistant."])
def test_chat_template_renders_what_the_model_was_trained_on(tokenizer, system) -> None:
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == chat_prompt("What is 2 + 3?", system)


def test_chat_text_round_trips_through_tokens(tokenizer) -> None:
    for example in heldout_examples(3):
        text = "".join(render(example))
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


def test_a_reply_continues_its_prompt_tokens(tokenizer) -> None:
    """The engine tokenizes the prompt alone, then appends reply tokens: the training text must
    split the same way, and the longest held-out prompt must fit the context."""
    longest = 0
    for example in heldout(20):
        context, target = render(example)
        prompt_ids = tokenizer.encode(context, add_special_tokens=False)
        whole_ids = tokenizer.encode(context + target, add_special_tokens=False)
        assert whole_ids[: len(prompt_ids)] == prompt_ids
        longest = max(longest, len(whole_ids))
    assert longest <= 1024


def test_plain_prompts_start_with_bos(tokenizer) -> None:
    assert tokenizer.encode("Once upon a time")[0] == tokenizer.bos_token_id


def test_shipped_tokenizer_is_rebuilt_byte_for_byte(tmp_path) -> None:
    """Corpus generator + BPE training reproduce what the shipped models were trained with."""
    from demo_training.train import build_tokenizer

    build_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (demo_model_path("target") / name).read_bytes()
