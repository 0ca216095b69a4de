"""Engine flags for every command, generated from the `EngineConfig` fields (as vLLM derives
its flags from its config dataclasses): a field's type, default, choices and help make its
flag, so a new field is a new flag and the two cannot disagree."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any

from tokenmill.config import ConfigError, EngineConfig

# The engine flags by what they set: a command's `--help` lists them by section
# (entrypoints/sectioned_help.py). Every `EngineConfig` field is in exactly one.
ENGINE_SECTIONS: dict[str, tuple[str, ...]] = {
    "model": (
        "model",
        "tokenizer",
        "task",
        "dtype",
        "device",
        "seed",
        "linear_backend",
        "quantization",
        "attention_backend",
        "enforce_eager",
        "generation_config",
        "max_model_len",
    ),
    "cache": (
        "block_size",
        "num_kv_blocks",
        "kv_cache_memory",
        "gpu_memory_utilization",
        "kv_cache_dtype",
        "enable_prefix_caching",
        "preemption_mode",
        "swap_space",
    ),
    "scheduler": (
        "max_num_batched_tokens",
        "max_num_seqs",
        "enable_chunked_prefill",
        "scheduling_policy",
        "itl_target_ms",
        "long_prefill_token_threshold",
        "max_num_partial_prefills",
    ),
    "decoding": ("speculative_config", "structured_outputs_config"),
    "parallel": (
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "nnodes",
        "distributed_timeout",
        "distributed_executor_backend",
        "kv_transfer_config",
        "kv_events_config",
    ),
    "lora": ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineConfig)
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    sectioned = [name for names in ENGINE_SECTIONS.values() for name in names]
    if sorted(sectioned) != sorted(fields):
        raise RuntimeError(f"ENGINE_SECTIONS must name each EngineConfig field once: {sectioned}")
    for title, names in ENGINE_SECTIONS.items():
        group = parser.add_argument_group(title)
        for config_field in (fields[name] for name in names):
            _add_flag(group, config_field, hints[config_field.name])


def _add_flag(group: argparse._ArgumentGroup, config_field: dataclasses.Field, hint: Any) -> None:
    group.add_argument(
        *flag_names(config_field),
        dest=config_field.name,
        **_argparse_kwargs(config_field, hint),
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = EngineConfig.field_names()
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def flag_names(config_field: dataclasses.Field) -> tuple[str, ...]:
    """`--max-num-seqs` for `max_num_seqs`, unless the field names its flags (vLLM's first)."""
    return config_field.metadata["flags"] or ("--" + config_field.name.replace("_", "-"),)


def _argparse_kwargs(config_field: dataclasses.Field, hint: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "default": config_field.default,
        "help": config_field.metadata["help"],
    }
    value_type = _without_none(hint)
    if value_type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif config_field.metadata["choices"] is not None:
        kwargs["choices"] = config_field.metadata["choices"]
    elif value_type in (int, float, str):
        kwargs["type"] = value_type
        kwargs["metavar"] = flag_names(config_field)[0].removeprefix("--").replace("-", "_").upper()
    else:  # a nested config read from JSON, e.g. --speculative-config
        kwargs["type"] = _argparse_type(value_type.parse)
        kwargs["metavar"] = "JSON"
    return kwargs


def _without_none(hint: Any) -> Any:
    """`int` for `int | None`."""
    if isinstance(hint, types.UnionType):
        (value_type,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return value_type
    return hint


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, its `ConfigError` shown by argparse as the flag's error message."""

    def parse_flag(value: str) -> Any:
        try:
            return parse(value)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    return parse_flag
