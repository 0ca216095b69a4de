"""`--speculative-config`: which speculative decoding method, how many tokens, with what."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenmill.config.base import ConfigError, check_choice, json_config_fields

# ngram: prompt lookup; draft_model: a smaller model; eagle / medusa: heads on the target;
# suffix: suffix tries over the request and recent outputs (no model); mtp: the target
# checkpoint's own multi-token-prediction layer.
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "medusa", "suffix", "mtp")
# Methods that draft without a model (no draft KV, nothing to load).
MODEL_FREE_METHODS = ("ngram", "suffix")


@dataclass
class SpeculativeConfig:
    """`--speculative-config` as vLLM takes it, e.g. `{"method": "ngram",
    "num_speculative_tokens": 4, "prompt_lookup_max": 5}`, `{"method": "draft_model",
    "model": PATH, "num_speculative_tokens": 4}`, or `{"method": "eagle"}` / `{"method":
    "medusa"}` with `model` the heads' directory (default: the demo target's heads), or
    `{"method": "suffix", "num_speculative_tokens": 8}` with vLLM's suffix_decoding_* knobs,
    or `{"method": "mtp"}` (the MTP layer in the target's checkpoint, or in `model`)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # the draft model's (draft_model), the heads' or MTP's directory
    # Pick k per step (down to 0) from measured throughput; False: always num_speculative_tokens.
    adaptive: bool = True
    # EAGLE's layer and LM head for drafting: "int8" weights (a quarter of the bytes a draft
    # streams), "full" (the model's dtype), "auto" (int8 on the CPU in float32 where torch has
    # the kernel). Drafts only: verification is the target's, in its own dtype.
    draft_weights: str = "auto"
    # suffix: substrings of up to this many tokens are indexed (and matched).
    suffix_decoding_max_tree_depth: int = 24
    # suffix: outputs of this many finished requests are kept for matching (0: none).
    suffix_decoding_max_cached_requests: int = 10000
    # suffix: at most match length * this many drafts.
    suffix_decoding_max_spec_factor: float = 1.0
    # suffix: stop drafting where the estimated probability falls below this.
    suffix_decoding_min_token_prob: float = 0.1

    @classmethod
    def parse(
        cls, value: str | dict[str, Any] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_config_fields(value, "speculative_config", cls)
        if "method" not in value:
            raise ConfigError(
                f"speculative_config needs a method: one of {', '.join(SPECULATIVE_METHODS)}"
            )
        value = {"num_speculative_tokens": 4, **value}
        for name, given in value.items():
            _check_json_type(name, given, SPECULATIVE_FIELD_TYPES[name])
        return cls(**value)

    def __post_init__(self) -> None:
        check_choice("speculative method", self.method, SPECULATIVE_METHODS)
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        check_choice("speculative draft_weights", self.draft_weights, ("auto", "int8", "full"))
        if self.suffix_decoding_max_tree_depth < 1:
            raise ConfigError("suffix_decoding_max_tree_depth must be >= 1")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ConfigError("suffix_decoding_max_cached_requests must be >= 0")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ConfigError("suffix_decoding_max_spec_factor must be > 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ConfigError("suffix_decoding_min_token_prob must be in [0, 1]")


# The JSON types each `--speculative-config` key takes (bool is not an int here).
SPECULATIVE_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "method": (str,),
    "num_speculative_tokens": (int,),
    "prompt_lookup_min": (int,),
    "prompt_lookup_max": (int,),
    "model": (str, type(None)),
    "adaptive": (bool,),
    "draft_weights": (str,),
    "suffix_decoding_max_tree_depth": (int,),
    "suffix_decoding_max_cached_requests": (int,),
    "suffix_decoding_max_spec_factor": (int, float),
    "suffix_decoding_min_token_prob": (int, float),
}
_JSON_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    type(None): "null",
}


def _check_json_type(name: str, given: Any, allowed: tuple[type, ...]) -> None:
    if type(given) in allowed:  # exact: True is not an integer, 4.0 is not one either
        return
    expected = " or ".join(_JSON_TYPE_NAMES[t] for t in allowed)
    raise ConfigError(f"speculative_config {name} must be {expected}, got {json.dumps(given)[:80]}")
