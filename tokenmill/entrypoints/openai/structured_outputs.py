"""The request's structured-output fields -> `StructuredOutputsParams`, as vLLM reads them:
`response_format`, then `structured_outputs`, then the older `guided_*` fields."""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.errors import bad_request
from tokenmill.entrypoints.openai.protocol import SamplingRequest
from tokenmill.structured_output import StructuredOutputsParams

_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_outputs_params(request: SamplingRequest) -> StructuredOutputsParams | None:
    """None when the request constrains nothing. Several constraints at once are a 400 naming
    the later field; an invalid schema or regex is a 400 from the engine, before any work."""
    fields: dict[str, Any] = {}
    param = None
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        param = "structured_outputs"
    for name, kind in _GUIDED_FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            param = _add(fields, kind, value, name, param)
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        value: Any = True
        kind = response_format.type
        if kind == "json_schema":
            schema = response_format.json_schema
            if schema is None or schema.json_schema is None:
                raise bad_request(
                    "response_format of type json_schema needs json_schema.schema",
                    param="response_format",
                )
            kind, value = "json", schema.json_schema
        param = _add(fields, kind, value, "response_format", param)
    if param is None:
        return None
    return StructuredOutputsParams(**fields, param=param)


def _add(fields: dict[str, Any], kind: str, value: Any, param: str, previous: str | None) -> str:
    constraints = set(fields) - {"disable_any_whitespace"}
    if constraints:
        raise bad_request(
            f"{param} cannot be combined with {previous} (one output constraint per request)",
            param=param,
        )
    fields[kind] = value
    return param
