"""The two requests the disaggregating router makes of one client request: the prefill leg
(the prompt to one token, its KV held for the decode instance) and the decode leg (the
client's request as sent, plus where the KV waits). Plain JSON in, JSON out."""

from __future__ import annotations

import json
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# Fields that shape only the tokens sampled, never the prompt: the prefill leg drops them so
# that it samples its one token freely and ends by length (only then is its KV handed over).
_SAMPLING_ONLY = (
    "stop", "stop_token_ids", "min_tokens", "stream_options", "logprobs", "top_logprobs",
    "echo", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "best_of", "suffix",
)  # fmt: skip


def parse(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, None if it is not one (the decode instance answers it)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def disaggregable(path: str, body: dict[str, Any]) -> bool:
    """A request whose prompt is prefilled elsewhere: one prompt (a batch of completions
    prompts is served whole by a decode instance), no prompt logprobs (`echo` with
    `logprobs`: every prompt position's logits are needed where it decodes), and no
    `kv_transfer_params` of the client's own."""
    if "kv_transfer_params" in body:
        return False
    if path == CHAT:
        return True
    if path != COMPLETIONS:
        return False
    if body.get("echo") and body.get("logprobs") is not None:
        return False
    return _single_prompt(body.get("prompt"))


def _single_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return True
    return isinstance(prompt, list) and len(prompt) == 1


def prefill_body(path: str, body: dict[str, Any]) -> bytes:
    """The prompt, to one token, not streamed, with its KV held for `n` decode requests."""
    leg = {k: v for k, v in body.items() if k not in _SAMPLING_ONLY}
    leg.update(stream=False, n=1, ignore_eos=True, max_tokens=1)
    if path == CHAT:
        leg["max_completion_tokens"] = 1
    num_samples = body.get("n", 1)
    transfer: dict[str, Any] = {"do_remote_decode": True}
    if isinstance(num_samples, int) and num_samples > 1:
        transfer["num_consumers"] = num_samples
    leg["kv_transfer_params"] = transfer
    return json.dumps(leg).encode()


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> bytes:
    """The client's request; with where its prompt's KV waits, if a prefill leg said."""
    if kv_transfer_params is None:
        return json.dumps(body).encode()
    return json.dumps({**body, "kv_transfer_params": kv_transfer_params}).encode()


def kv_transfer_failed(status: int, content: bytes) -> bool:
    """Whether an answer (a plain body, or a stream's first event) is the decode instance
    saying that the prompt's KV did not arrive."""
    if content.startswith(b"data:"):
        content = content[len(b"data:") :].split(b"\n\n", 1)[0]
    elif status < 500:
        return False
    value = parse(content.strip())
    error = value.get("error") if value else None
    return isinstance(error, dict) and error.get("code") == "kv_transfer_failed"
