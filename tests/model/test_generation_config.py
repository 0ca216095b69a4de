"""Default sampling parameters from the model's generation_config.json, as vLLM applies them."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError
from tokenmill.entrypoints.cli import main
from tokenmill.models.loader import sampling_defaults

PROMPTS = [[5, 9, 13, 200], [7, 7, 31]]


def _with_generation_config(source: Path, destination: Path, **fields: object) -> Path:
    shutil.copytree(source, destination)
    path = destination / "generation_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **fields}))
    return destination


def test_only_fields_the_file_sets_are_defaults(tiny_checkpoint, tmp_path: Path) -> None:
    plain = tiny_checkpoint("llama")
    assert "eos_token_id" in json.loads((plain / "generation_config.json").read_text())
    assert sampling_defaults(plain) == {}
    model = _with_generation_config(
        plain, tmp_path / "m", do_sample=True, temperature=0.6, top_k=20
    )
    assert sampling_defaults(model) == {"temperature": 0.6, "top_k": 20}
    assert sampling_defaults(tmp_path) == {}  # no file at all


def test_broken_generation_config_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{temperature: 0.5")
    with pytest.raises(ValueError, match=r"generation_config\.json is not valid JSON"):
        sampling_defaults(tmp_path)


def test_generate_without_params_uses_the_model_defaults(tiny_checkpoint, tmp_path: Path) -> None:
    """A near-zero default temperature makes unparameterised generation greedy; with
    generation_config="vllm" the same call samples at temperature 1.0 and differs."""
    model = _with_generation_config(tiny_checkpoint("llama"), tmp_path / "m", temperature=1e-5)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=str(model), dtype="float32", max_model_len=64)
    defaults = llm.get_default_sampling_params(max_tokens=12, ignore_eos=True)
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (1e-5, 1.0, 12)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, defaults, use_tqdm=False)]
    assert got == expected
    unparameterised = llm.generate(PROMPTS, use_tqdm=False)
    assert [o.outputs[0].token_ids[:12] for o in unparameterised] == expected

    ignored = LLM(model=str(model), dtype="float32", max_model_len=64, generation_config="vllm")
    assert ignored.get_default_sampling_params().temperature == 1.0
    sampled = ignored.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True, seed=1))
    assert [o.outputs[0].token_ids for o in sampled] != expected


def test_generation_config_from_another_directory(tiny_checkpoint, tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    llm = LLM(
        model=str(tiny_checkpoint("llama")),
        dtype="float32",
        max_model_len=64,
        generation_config=str(tmp_path),
    )
    assert llm.get_default_sampling_params().top_p == 0.5


def test_transformers_default_top_k_is_not_a_model_default(tiny_checkpoint, tmp_path) -> None:
    model = _with_generation_config(tiny_checkpoint("llama"), tmp_path / "m", top_k=50, top_p=0.9)
    assert sampling_defaults(model) == {"top_p": 0.9}


def test_max_new_tokens_is_the_default_max_tokens(tiny_checkpoint, tmp_path: Path) -> None:
    model = _with_generation_config(tiny_checkpoint("llama"), tmp_path / "m", max_new_tokens=7)
    llm = LLM(model=str(model), max_model_len=64)
    assert llm.get_default_sampling_params().max_tokens == 7
    params = llm.get_default_sampling_params(ignore_eos=True)
    output = llm.generate([[5, 9, 13]], params, use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 7


def test_bad_generation_config_fails_at_start_up(tiny_checkpoint, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="has none"):
        LLM(model=str(tiny_checkpoint("llama")), generation_config=str(tmp_path / "typo"))
    model = _with_generation_config(tiny_checkpoint("llama"), tmp_path / "m", temperature=-1.0)
    with pytest.raises(ConfigError, match="invalid default"):
        LLM(model=str(model), max_model_len=64)


def _generated_texts(capsys: pytest.CaptureFixture[str], model: Path, *flags: str) -> list[str]:
    argv = ["generate", "--model", str(model), "--prompt", "a b c", "--n", "3", "--max-tokens"]
    argv += ["8", "--ignore-eos", "--dtype", "float32", "--max-model-len", "64", *flags]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    return [text for header, text in itertools.pairwise(lines) if header.startswith("--- prompt")]


def test_tokenmill_generate_samples_with_the_model_defaults_as_the_server_does(
    tiny_checkpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The engine logs the generation_config.json defaults; `generate` must use them (a high
    default temperature makes 3 samples differ) unless a flag says otherwise."""
    model = _with_generation_config(tiny_checkpoint("llama"), tmp_path / "m", temperature=50.0)
    sampled = _generated_texts(capsys, model)
    assert len(sampled) == 3 and len(set(sampled)) > 1
    greedy = _generated_texts(capsys, model, "--temperature", "0")
    assert len(greedy) == 3 and len(set(greedy)) == 1
