"""`--structured-outputs-config`: the grammar backend and what one tenant's schema may cost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.config.base import ConfigError, check_choice, json_config_fields, positive_int

# Structured outputs: the backends vLLM names; "auto" and "xgrammar" both mean xgrammar, the
# only one here.
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")


@dataclass
class StructuredOutputsConfig:
    """`--structured-outputs-config` as vLLM takes it (JSON), e.g. `{"max_whitespace": null}`.
    vLLM's keys: `backend`, `disable_any_whitespace`; the rest bound what one tenant's schema
    can cost everyone else (docs/server.md, "Structured outputs")."""

    backend: str = "auto"
    disable_any_whitespace: bool = False  # every request's JSON compact, as if it asked
    # Whitespace characters allowed between two JSON tokens (1: `{"a": 1}` or a newline, not
    # an indented line); None: any amount, which a small model at temperature 1 spends
    # padding to max_tokens with spaces and newlines.
    max_whitespace: int | None = 1
    # Bytes of a schema, regex, grammar or choice list (as JSON text); larger ones are a 400.
    max_schema_bytes: int = 64 * 1024
    # Seconds a request waits for its grammar to compile; past it, a 400 (a request of the
    # offline API ends with finish_reason "error").
    compile_timeout: float = 30.0
    # Compiled grammars kept, by xgrammar's own size of each (vLLM's default, 512 MiB).
    cache_max_bytes: int = 512 * 1024**2

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | StructuredOutputsConfig | None
    ) -> StructuredOutputsConfig:
        if value is None or isinstance(value, StructuredOutputsConfig):
            return value or cls()
        value = json_config_fields(value, "structured_outputs_config", cls)
        return cls(**value)

    def __post_init__(self) -> None:
        check_choice("structured_outputs_config backend", self.backend, STRUCTURED_OUTPUTS_BACKENDS)
        if not isinstance(self.disable_any_whitespace, bool):
            raise ConfigError("structured_outputs_config disable_any_whitespace must be a boolean")
        if self.max_whitespace is not None and not positive_int(self.max_whitespace):
            raise ConfigError(
                "structured_outputs_config max_whitespace must be a positive integer or null "
                f"(any whitespace), got {self.max_whitespace!r}"
            )
        for name in ("max_schema_bytes", "cache_max_bytes"):
            if not positive_int(getattr(self, name)):
                raise ConfigError(
                    f"structured_outputs_config {name} must be a positive integer, "
                    f"got {getattr(self, name)!r}"
                )
        timeout = self.compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ConfigError(
                f"structured_outputs_config compile_timeout must be > 0 s, got {timeout!r}"
            )
