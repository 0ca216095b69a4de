"""`tokenmill serve` on the families beyond Llama (models/families/): each checkpoint's own
chat template renders the conversation (as transformers renders it) and the reply is the
model's greedy continuation of that prompt."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from server_clients import keyed_http
from server_utils import MODEL, start_server, stop_server
from transformers import AutoTokenizer

from tokenmill import LLM, SamplingParams

# Gemma's and Phi-3's turn markers, written as the checkpoints' templates write them.
TEMPLATES = {
    "gemma3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
        " + '\\n' + message['content'] + '<end_of_turn>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
    "phi3": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content']"
        " + '<|end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    ),
}
KWARGS = {"gemma3": {"head_dim": 16, "sliding_window": 4}, "phi3": {"partial_rotary_factor": 0.5}}
MESSAGES = [{"role": "user", "content": "Reverse this list: apple banana cherry"}]


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_serve_renders_the_checkpoints_chat_template(
    family: str, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tmp_path / family
    shutil.copytree(tiny_checkpoint(family, **KWARGS[family]), model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TEMPLATES[family]
    config_path.write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    expected_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    offline = LLM(model=str(model_dir), dtype="float32", max_model_len=128)
    expected_text = offline.generate([expected_ids], greedy, use_tqdm=False)[0].outputs[0].text
    del offline

    server = start_server(model_dir, tmp_path / "server.log", "--max-model-len", "128")
    try:
        with keyed_http(server) as http:
            tokenized = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES})
            assert tokenized.status_code == 200, tokenized.text
            tokenized = tokenized.json()
            assert tokenized["tokens"] == expected_ids
            body = {
                "model": MODEL,
                "messages": MESSAGES,
                "temperature": 0,
                "max_tokens": 6,
                "ignore_eos": True,
            }
            reply = http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            assert reply.json()["usage"]["prompt_tokens"] == len(expected_ids)
            assert choice["message"]["content"] == expected_text
    finally:
        stop_server(server)
