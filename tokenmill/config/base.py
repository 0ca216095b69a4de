"""What every setting shares: its error type, parsing a JSON-valued setting, a choice
check, and `config_field` (a field that also describes its CLI flag)."""

from __future__ import annotations

import json
from dataclasses import field, fields
from typing import Any


class ConfigError(ValueError):
    """An engine setting is invalid or inconsistent with the model."""


def json_config_fields(value: str | dict[str, Any], name: str, cls: type) -> dict[str, Any]:
    """A JSON-valued setting (`--speculative-config '{...}'` or a dict) as a dict whose keys are
    fields of the dataclass `cls`; one ConfigError naming the setting otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object")
    unknown = set(value) - {f.name for f in fields(cls)}
    if unknown:
        raise ConfigError(f"unknown {name} keys: {sorted(unknown)}")
    return value


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")


def config_field(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    flags: tuple[str, ...] = (),
) -> Any:
    """A config field that also describes its CLI flag (entrypoints/engine_args.py): `help`,
    `choices` (also checked by `EngineConfig.__post_init__`) and `flags`, the flag names when
    they differ from the field's (vLLM's name first, older names after it as aliases)."""
    metadata: dict[str, Any] = {"help": help, "choices": choices, "flags": flags}
    return field(default=default, metadata=metadata)


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
