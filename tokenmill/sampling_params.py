"""Per-request sampling parameters, shaped like OpenAI's and vLLM's."""

from __future__ import annotations

import copy
import json as jsonlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

_MAX_SEED = 2**63 - 1
# Stop strings and stop token ids per request: every generated token is checked against each
# (the stop strings on the engine thread), so a body of 100,000 would slow every other
# request's steps. OpenAI allows 4 stop strings; this is generous.
MAX_STOPS = 256


class RequestOutputKind(Enum):
    """How much of the output each `RequestOutput` carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output (streaming)
    FINAL_ONLY = 2  # nothing until the request finishes (offline batch)


@dataclass
class SamplingParams:
    """What to generate and how to pick each token.

    Values are validated when the object is made, so a bad request fails at the edge with a
    `ValueError` naming the field, never inside the engine loop.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # number of top log-probabilities besides the sampled token's
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    # A slow (Python) tokenizer's decode option, as in vLLM; fast ones join added tokens as is.
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # JSON schema / regex / choice / grammar the output must match (a dict is converted).
    structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None
    # vLLM's: what engine extensions read, e.g. {"kv_transfer_params": {...}} for a KV
    # connector (docs/scale_out.md).
    extra_args: dict[str, Any] | None = None
    # Set by the engine from the model's generation config; not a user knob.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1, 0 or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        if self.seed is not None:
            _check(
                isinstance(self.seed, int) and -_MAX_SEED <= self.seed <= _MAX_SEED,
                "seed",
                f"must be an integer within 64 bits, got {self.seed}",
            )
        if self.max_tokens is not None:
            _check(self.max_tokens >= 0, "max_tokens", f"must be >= 0, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(value >= 0, name, f"must be >= 0, got {value}")
        _check(all(s for s in self.stop), "stop", "must not contain empty strings")
        for name in ("stop", "stop_token_ids"):
            count = len(getattr(self, name))
            _check(count <= MAX_STOPS, name, f"has {count} entries; at most {MAX_STOPS} allowed")
        _check(
            self.extra_args is None or isinstance(self.extra_args, dict),
            "extra_args",
            "must be a dict",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        for token_id, bias in (self.logit_bias or {}).items():
            _check(
                -100.0 <= bias <= 100.0,
                "logit_bias",
                f"bias for token {token_id} must be in [-100, 100], got {bias}",
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)


# ---- structured outputs ---------------------------------------------------------------------
# What a request asks its output to match, as vLLM's `StructuredOutputsParams`: exactly one of
# `json` (a JSON schema), `regex`, `choice`, `grammar` (EBNF) or `json_object` (any JSON
# object). The shape is checked here; whether the schema, regex or grammar itself is valid is
# checked by the engine before the request is queued (`structured_output.backend.validate`).

STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Objects and arrays inside one another in a JSON schema: deeper ones are refused before any
# recursive check sees them (Python's recursion limit would turn them into a 500).
MAX_SCHEMA_DEPTH = 64


@dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # As vLLM: no whitespace between JSON tokens beyond what the schema needs.
    disable_any_whitespace: bool = False
    # vLLM's options for its other backends, accepted for its clients: xgrammar has no
    # fallback and never adds properties a strict schema leaves out, so both change nothing.
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    # vLLM's too, refused unless unset: xgrammar has no whitespace pattern or structural tags.
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # The text that ends a reasoning model's thinking ("</think>"): the output is free until
    # it has written this, and constrained after it (vLLM starts the grammar where its
    # reasoning parser sees the reasoning end). None: constrained from the first token.
    reasoning_end: str | None = None
    # The request field it came from, named in errors ("response_format", "guided_json").
    param: str = field(default="structured_outputs", compare=False, repr=False)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        """From a dict with vLLM's keys; an unknown key is an `InvalidRequestError` naming it."""
        param = fields.get("param", "structured_outputs")
        known = [name for name in cls.__dataclass_fields__ if name != "param"]
        unknown = [key for key in fields if key not in (*known, "param")]
        if unknown:
            raise InvalidRequestError(
                f"{param}.{unknown[0]}",
                f"is not a structured output option (they are {', '.join(known)})",
            )
        return cls(**fields)

    def __post_init__(self) -> None:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise InvalidRequestError(
                    f"{self.param}.{name}",
                    "is not supported by this server's backend (xgrammar); for compact JSON "
                    "set disable_any_whitespace",
                )
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidRequestError(
                self.param,
                f"must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; "
                f"got {', '.join(kinds) or 'none'}",
            )
        if isinstance(self.json, str):
            try:
                self.json = jsonlib.loads(self.json)
            except ValueError as e:
                raise InvalidRequestError(self.param, f"json is not valid JSON: {e}") from None
            except RecursionError:
                raise InvalidRequestError(
                    self.param, f"json nests more than {MAX_SCHEMA_DEPTH} levels deep"
                ) from None
        if self.json is not None and not isinstance(self.json, dict):
            raise InvalidRequestError(self.param, "json must be a JSON schema object")
        if json_depth(self.json) > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(
                self.param,
                f"json nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep",
            )
        if self.choice is not None and not (
            self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise InvalidRequestError(self.param, "choice must be a non-empty list of strings")
        if self.reasoning_end is not None and not (
            isinstance(self.reasoning_end, str) and self.reasoning_end
        ):
            raise InvalidRequestError(self.param, "reasoning_end must be a non-empty string")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidRequestError(self.param, f"{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str, bool]:
        """Equal for requests that compile to the same grammar."""
        spec = getattr(self, self.kind)
        text = spec if isinstance(spec, str) else jsonlib.dumps(spec, sort_keys=True)
        return self.kind, text, self.disable_any_whitespace


def json_depth(value: Any, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """How deeply objects and arrays nest in `value` (0 for a scalar), without recursion;
    past `limit` the walk stops (deep enough to refuse)."""
    depth = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if isinstance(item, dict | list):
            depth = max(depth, level)
            if depth > limit:
                return depth
            stack.extend((child, level + 1) for child in children)
    return depth


class InvalidRequestError(ValueError):
    """A request parameter is out of range; `param` names it (the OpenAI error's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise InvalidRequestError(param, message)
