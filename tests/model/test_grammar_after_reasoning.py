"""A constraint with `reasoning_end` leaves a reasoning model's thinking free and holds from
the token after its end tag, as vLLM's grammar starts where its reasoning parser sees the
reasoning end: on a model scripted to think before it answers (tokenmill_testing), with the
end tag one added token (Qwen3) or several ordinary ones, with and without speculation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.demo import demo_model_path
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill_testing.scripted_checkpoint import save_scripted_checkpoint

CHAT = [{"role": "user", "content": "Repeat: I add two.</think>yes"}]
CHOICE = ["no", "maybe"]


@pytest.fixture(scope="module", params=["tag tokens", "text"])
def thinker(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, str]:
    """(engine, its unconstrained reply): `<think>` and `</think>` as added tokens, or
    `</think>` spelled by the BPE (".</", "th", "ink", ">") after an opened reasoning."""
    save_dir = tmp_path_factory.mktemp("thinker")
    if request.param == "tag tokens":
        reply, added = "<think>I add two.</think>yes", ["<think>", "</think>"]
    else:
        reply, added = "I add two.</think>yes", []
    save_scripted_checkpoint(save_dir, reply, demo_model_path("target"), added)
    return LLM(model=str(Path(save_dir)), dtype="float32", max_model_len=256), reply


def _reply(llm: LLM, structured: StructuredOutputsParams | None) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=structured)
    (output,) = llm.chat(CHAT, params, use_tqdm=False)
    assert output.outputs[0].finish_reason == "stop"
    return output.outputs[0].text


def test_the_script_is_the_greedy_reply(thinker) -> None:
    llm, reply = thinker
    assert _reply(llm, None) == reply


def test_the_constraint_holds_after_the_reasoning_only(thinker) -> None:
    llm, reply = thinker
    thinking = reply.removesuffix("yes")
    choice = StructuredOutputsParams(choice=CHOICE, reasoning_end="</think>")
    text = _reply(llm, choice)
    assert text.startswith(thinking) and text.removeprefix(thinking) in CHOICE
    # Without reasoning_end the constraint holds from the first token: no thinking.
    assert _reply(llm, StructuredOutputsParams(choice=CHOICE)) in CHOICE


def test_drafts_that_end_the_reasoning_keep_the_reply(tmp_path: Path) -> None:
    """N-gram lookup drafts ".</", "th", "ink", ">" and on from the prompt: the draft that
    completes the end tag waits a step, and the reply is the one without speculation."""
    save_scripted_checkpoint(tmp_path, "I add two.</think>yes", demo_model_path("target"))
    choice = StructuredOutputsParams(choice=CHOICE, reasoning_end="</think>")
    plain = LLM(model=str(tmp_path), dtype="float32", max_model_len=256)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    drafted = LLM(model=str(tmp_path), dtype="float32", max_model_len=256, speculative_config=spec)
    text = _reply(drafted, choice)
    assert text == _reply(plain, choice)
    assert drafted.get_stats().scheduler.spec_decode.num_accepted_tokens > 0
