"""What a request asks its output to match: vLLM's `StructuredOutputsParams`, without xgrammar.

Exactly one of `json` (a JSON schema), `regex`, `choice`, `grammar` (EBNF) or `json_object`
(any JSON object) is set. The shape is checked when the object is made; whether the schema,
regex or grammar itself is valid is checked by the engine before the request is queued
(`structured_output.backend.validate`), so both errors come before any work.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, field
from typing import Any

from tokenmill.sampling_params import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # As vLLM: no whitespace between JSON tokens beyond what the schema needs.
    disable_any_whitespace: bool = False
    # The request field it came from, named in errors ("response_format", "guided_json").
    param: str = field(default="structured_outputs", compare=False, repr=False)

    def __post_init__(self) -> None:
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidRequestError(
                self.param,
                f"must set exactly one of {', '.join(KINDS)}; got {', '.join(kinds) or 'none'}",
            )
        if isinstance(self.json, str):
            try:
                self.json = jsonlib.loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(self.param, f"json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise InvalidRequestError(self.param, "json must be a JSON schema object")
        if self.choice is not None and not (
            self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequestError(self.param, "choice must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidRequestError(self.param, f"{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str, bool]:
        """Equal for requests that compile to the same grammar."""
        spec = getattr(self, self.kind)
        text = spec if isinstance(spec, str) else jsonlib.dumps(spec, sort_keys=True)
        return self.kind, text, self.disable_any_whitespace
