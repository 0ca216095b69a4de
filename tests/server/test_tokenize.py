"""/tokenize and /detokenize: the server's own tokenizer, as vLLM exposes it."""

from __future__ import annotations

import httpx
from server_utils import MAX_MODEL_LEN, MODEL


def test_tokenize_then_detokenize_round_trips(http: httpx.Client) -> None:
    text = "Round trip, with punctuation: 42!"
    tokenized = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 0
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert tokenized["tokens"][-plain["count"] :] == plain["tokens"]  # the BOS comes first
    detokenized = http.post("/detokenize", json={"tokens": plain["tokens"]}).json()
    assert detokenized == {"prompt": text}


def test_tokenize_chat_renders_the_template(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    assert "<|im_start|>" in chat["token_strs"]
    shorter = http.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()
    assert shorter["count"] < chat["count"]


def test_tokenize_needs_exactly_one_of_prompt_and_messages(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    for body in ({}, {"prompt": "x", "messages": messages}):
        response = http.post("/tokenize", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "prompt"
