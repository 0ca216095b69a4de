"""Engine flags are generated from `EngineConfig`: one flag per field, with its default, choices
and help, under vLLM's names."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tokenmill.config import SPECULATIVE_FIELD_TYPES, ConfigError, EngineConfig, SpeculativeConfig
from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args, flag_names


def parse(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser(prog="test")
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(argv))


def engine_actions() -> dict[str, object]:
    parser = argparse.ArgumentParser(prog="test")
    add_engine_args(parser)
    return {action.dest: action for action in parser._actions if action.dest != "help"}


def test_every_field_has_a_flag_whose_default_is_the_fields() -> None:
    defaults = EngineConfig()
    parsed = parse()
    for field in dataclasses.fields(EngineConfig):
        assert getattr(parsed, field.name) == getattr(defaults, field.name), field.name
    assert set(engine_actions()) == EngineConfig.field_names()


def test_every_flag_has_help_and_the_fields_choices() -> None:
    actions = engine_actions()
    for field in dataclasses.fields(EngineConfig):
        action = actions[field.name]
        assert action.help and action.help == field.metadata["help"], field.name
        assert action.choices == field.metadata["choices"], field.name
        assert action.option_strings[: len(flag_names(field))] == list(flag_names(field))


def test_flag_values_are_typed_and_checked() -> None:
    config = parse("--max-num-seqs", "3", "--swap-space", "1.5", "--no-enable-prefix-caching")
    assert (config.max_num_seqs, config.swap_space, config.enable_prefix_caching) == (3, 1.5, False)
    with pytest.raises(SystemExit):
        parse("--dtype", "float64")
    with pytest.raises(SystemExit):
        parse("--max-num-seqs", "many")


@pytest.mark.parametrize(
    ("flag", "field"),
    [
        ("--num-gpu-blocks-override", "num_kv_blocks"),
        ("--num-kv-blocks", "num_kv_blocks"),
        ("--kv-cache-memory-bytes", "kv_cache_memory"),
        ("--kv-cache-memory", "kv_cache_memory"),
    ],
)
def test_kv_sizing_flags_take_vllms_names_and_the_old_ones(flag: str, field: str) -> None:
    assert getattr(parse(flag, "4096"), field) == 4096


def test_speculative_config_is_parsed_at_the_flag() -> None:
    config = parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert config.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)


def test_a_bad_speculative_config_names_the_flag_and_the_problem(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse("--speculative-config", '{"method": "ngram"')
    error = capsys.readouterr().err
    assert "--speculative-config" in error and "not valid JSON" in error


def test_engine_config_takes_only_a_parsed_speculative_config() -> None:
    with pytest.raises(ConfigError, match="SpeculativeConfig"):
        EngineConfig(speculative_config={"method": "ngram"})  # type: ignore[arg-type]


def test_choices_are_checked_by_the_config_too() -> None:
    with pytest.raises(ConfigError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")


SPECULATIVE_JUNK = [
    '{"method": "ngram"',
    "[]",
    '"ngram"',
    "null",
    "NaN",
    "{}",
    '{"method": "magic"}',
    '{"method": 4}',
    '{"method": "ngram", "num_speculative_tokens": "4"}',
    '{"method": "ngram", "num_speculative_tokens": 0}',
    '{"method": "ngram", "num_speculative_tokens": 17}',
    '{"method": "ngram", "num_speculative_tokens": 4.0}',
    '{"method": "ngram", "num_speculative_tokens": true}',
    '{"method": "ngram", "num_speculative_tokens": null}',
    '{"method": "ngram", "num_speculative_tokens": 1e400}',
    '{"method": "ngram", "num_speculative_tokens": 99999999999999999999999}',
    '{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}',
    '{"method": "ngram", "prompt_lookup_max": -1}',
    '{"method": "ngram", "bogus": 1}',
    '{"method": "ngram", "adaptive": "yes"}',
    '{"method": "ngram", "draft_weights": "int4"}',
    '{"method": "draft_model", "model": 7}',
]


@pytest.mark.parametrize("junk", SPECULATIVE_JUNK)
def test_speculative_config_junk_is_a_one_line_error_naming_the_problem(
    junk: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse("--speculative-config", junk)
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert last_line.startswith("test: error: argument --speculative-config: ")
    assert "parse_flag" not in last_line  # argparse's "invalid <type> value", which says nothing


def test_a_wrong_type_names_the_field_and_the_expected_type(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse("--speculative-config", '{"method": "ngram", "num_speculative_tokens": "4"}')
    error = capsys.readouterr().err
    assert 'speculative_config num_speculative_tokens must be an integer, got "4"' in error


def test_every_speculative_config_key_has_its_json_type() -> None:
    names = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    assert set(SPECULATIVE_FIELD_TYPES) == names
