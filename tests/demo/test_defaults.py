"""With no model, tokenmill serves the demo target, and `{"method": "draft_model"}` without a
model drafts with the demo draft, which agrees with the target often enough to matter."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError
from tokenmill.demo import demo_model_path
from tokenmill.demo.eval import heldout

DEFAULT_DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "adaptive": False}


@pytest.fixture(scope="module")
def chats() -> list[list[dict[str, str]]]:
    examples = heldout(2, ["copy", "reverse", "sort", "lookup"])
    return [[{"role": "user", "content": e.prompt or ""}] for e in examples]


def test_no_model_means_the_demo_target() -> None:
    llm = LLM(dtype="float32", max_model_len=256)
    assert llm.engine.parts.model_dir == demo_model_path("target")
    reply = llm.chat(
        [[{"role": "user", "content": "Reverse this list: cat dog fish"}]],
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
    )
    assert reply[0].outputs[0].text == "fish dog cat"


def test_default_draft_is_the_demo_draft_and_changes_no_answer(chats) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=64)
    plain = LLM(dtype="float32")
    speculative = LLM(dtype="float32", speculative_config=DEFAULT_DRAFT)
    expected = [o.outputs[0].token_ids for o in plain.chat(chats, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in speculative.chat(chats, params, use_tqdm=False)]
    assert got == expected
    stats = speculative.get_stats().scheduler.spec_decode
    assert stats is not None and stats.num_draft_tokens > 0
    # Echoing tasks are where a trained draft agrees with its target (docs/demo_models.md).
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.5


def test_other_models_need_an_explicit_draft(tiny_checkpoint) -> None:
    with pytest.raises(ConfigError, match="needs a model path"):
        LLM(model=str(tiny_checkpoint("llama")), speculative_config={"method": "draft_model"})


def test_the_engine_itself_has_no_default_model() -> None:
    """The demo default is filled in by the entrypoints (`LLM`, `serve`), so the engine never
    imports the demo package; given no model directly, it says so."""
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    with pytest.raises(ConfigError, match="no model given"):
        LLMEngine(EngineConfig())
