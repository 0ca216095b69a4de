"""xgrammar: checking a request's grammar, compiling it for the tokenizer, one matcher each.

xgrammar is imported only here (and by `bitmask`), when the first structured request comes:
an engine that never sees one never loads it.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from tokenmill.config import StructuredOutputsConfig
from tokenmill.sampling_params import InvalidRequestError, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

# xgrammar's messages start with "[time] /path/file.cc:line: "; the rest is for the user.
_LOCATION_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_LOOSE_STRING_CHARACTER = r"([^\"\\\r\n])"
_JSON_STRING_CHARACTER = r"([^\0-\x1f\"\\\r\n])"
_WHAT = {
    "json": "JSON schema",
    "regex": "regular expression",
    "grammar": "EBNF grammar",
    "choice": "choice",
}
# Constraints that passed `validate` (by cache key), most recent last. The server validates
# on its tokenizer thread, so the engine thread's own check of the same request is a lookup
# (a large schema takes tens of milliseconds to check, a step every request waits on).
MAX_VALIDATED_KEYS = 1024
_validated: OrderedDict[tuple, None] = OrderedDict()
_validated_lock = threading.Lock()


def validate(params: StructuredOutputsParams) -> None:
    """Raise `InvalidRequestError` naming the request field if the schema, regex or grammar
    cannot be turned into a grammar. Cheap (no tokenizer involved): run before any work;
    a constraint that passed before is not checked again."""
    key = params.cache_key()
    with _validated_lock:
        if key in _validated:
            _validated.move_to_end(key)
            return
    _check(params)
    with _validated_lock:
        _validated[key] = None
        if len(_validated) > MAX_VALIDATED_KEYS:
            _validated.popitem(last=False)


def _check(params: StructuredOutputsParams) -> None:
    import xgrammar as xgr

    try:
        if params.kind == "json":
            _check_json_schema(params)
        if params.kind in ("json", "json_object"):
            _json_schema_grammar(params, xgr, None)  # what can fail; not re-parsed as `_grammar`
        else:
            _grammar(params, xgr, None)
    except InvalidRequestError:  # already says what is wrong, prefixed with the field
        raise
    except RecursionError:  # a backstop: `StructuredOutputsParams` bounds the nesting
        raise InvalidRequestError(
            params.param, f"is not a valid {_WHAT[params.kind]}: it is nested too deeply"
        ) from None
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidRequestError(
            params.param, f"is not a valid {_WHAT[params.kind]}: {_message(e)}"
        ) from None


def _check_json_schema(params: StructuredOutputsParams) -> None:
    """xgrammar ignores keywords it does not know; a malformed schema (say `"minimum": "x"`)
    should still be a 400, as OpenAI answers."""
    import jsonschema

    error = jsonschema.exceptions.best_match(_meta_validator(params.json).iter_errors(params.json))
    if error is not None:
        raise InvalidRequestError(params.param, f"is not a valid JSON schema: {error.message}")


@functools.cache
def _meta_validator_for(cls: type) -> Any:
    """A validator of schemas of one draft, built once (`check_schema` builds one per call)."""
    return cls(cls.META_SCHEMA)


def _meta_validator(schema: Any) -> Any:
    """The validator of the draft the schema declares (`$schema`), draft 7 if none: the
    draft OpenAI's and vLLM's examples are written to, and 5x quicker to check a large schema
    against than jsonschema's default, 2020-12 (35 vs 150 ms for benchmarks'
    "20 properties, 3 levels", on the engine thread)."""
    import jsonschema

    draft = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return _meta_validator_for(draft)


def _grammar(
    params: StructuredOutputsParams, xgr: xgrammar, max_whitespace: int | None
) -> xgrammar.Grammar:
    if params.kind in ("json", "json_object"):
        grammar = _json_schema_grammar(params, xgr, max_whitespace)
        return xgr.Grammar.from_ebnf(_escape_control_characters(str(grammar)))
    if params.kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if params.kind == "choice":
        # Each choice as an EBNF string literal (JSON's escapes are EBNF's).
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice or [])
        return xgr.Grammar.from_ebnf(f"root ::= {literals}")
    return xgr.Grammar.from_ebnf(params.grammar)


def _json_schema_grammar(
    params: StructuredOutputsParams, xgr: xgrammar, max_whitespace: int | None
) -> xgrammar.Grammar:
    """`max_whitespace`: whitespace characters allowed between two JSON tokens (None: any);
    `disable_any_whitespace` leaves only the single spaces of `", "` and `": "`."""
    strict = params.kind == "json"
    return xgr.Grammar.from_json_schema(
        json.dumps(params.json if strict else {"type": "object"}),
        any_whitespace=not params.disable_any_whitespace,
        strict_mode=strict,
        max_whitespace_cnt=None if params.disable_any_whitespace else max_whitespace,
    )


def _escape_control_characters(ebnf: str) -> str:
    """xgrammar 0.2.8 lets strings with a maxLength contain raw control characters, which
    JSON forbids (`json.loads` rejects them); its other strings exclude them, as here."""
    return ebnf.replace(_LOOSE_STRING_CHARACTER, _JSON_STRING_CHARACTER)


def _message(error: Exception) -> str:
    return _LOCATION_PREFIX.sub("", str(error).strip())


class XgrammarBackend:
    """Compiles grammars against one tokenizer's vocabulary (padded to the model's)."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: Iterable[int],
        max_whitespace: int | None = StructuredOutputsConfig.max_whitespace,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.max_whitespace = max_whitespace
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        # One thread: compiles run beside the engine loop on a shared CPU. Our own cache (in
        # the manager) holds compiled grammars, so xgrammar's is off.
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        return self.compiler.compile_grammar(_grammar(params, self._xgr, self.max_whitespace))

    def matcher(
        self, compiled: xgrammar.CompiledGrammar, stop_token_ids: list[int]
    ) -> xgrammar.GrammarMatcher:
        return self._xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
