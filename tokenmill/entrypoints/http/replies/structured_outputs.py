"""The request's structured-output fields -> `StructuredOutputsParams`, as vLLM reads them:
`response_format`, then `structured_outputs`, then the older `guided_*` fields."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any

from tokenmill.entrypoints.http.openai.protocol import SamplingRequest
from tokenmill.entrypoints.http.transport.errors import bad_request
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.structured_output.manager import StructuredOutputManager

# vLLM's backend names a request may give: both mean xgrammar, the one backend here.
_BACKENDS = ("auto", "xgrammar")
# What `structured_outputs` may set besides its one constraint.
_OPTIONS = {
    "disable_any_whitespace",
    "disable_fallback",
    "disable_additional_properties",
    "whitespace_pattern",
    "structural_tag",
}

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
        backend = fields.pop("backend", None)
        if backend is not None and backend not in _BACKENDS:
            raise bad_request(
                f"structured_outputs.backend {backend!r} is not available: this server's "
                f"backend is xgrammar (accepted names: {', '.join(_BACKENDS)})",
                param="structured_outputs.backend",
            )
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
    constraints = set(fields) - _OPTIONS
    if constraints:
        raise bad_request(
            f"{param} cannot be combined with {previous} (one output constraint per request)",
            param=param,
        )
    fields[kind] = value
    return param


async def prepare(
    manager: StructuredOutputManager, params: StructuredOutputsParams, validator: Executor
) -> None:
    """Validate the constraint on `validator` (not the tokenizer thread every request shares:
    a large schema takes a while to check), then wait for its grammar to compile, so that a
    schema too large, invalid, or slower to compile than `compile_timeout` is a 400 before
    any output. The engine then finds the grammar compiled. If this request is cancelled (the
    client left) or times out, its hold on the compile goes, and a compile nobody waits for
    is cancelled if it has not started."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(validator, manager.validate, params)
    compiled, release = manager.hold(params)
    timeout = manager.config.compile_timeout
    try:
        # shield: a timeout must not cancel the compile other requests may share
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compiled)), timeout)
    except TimeoutError:
        raise bad_request(
            f"{params.param}: the grammar did not compile within {timeout:g} s "
            "(structured_outputs_config compile_timeout); try a smaller schema",
            param=params.param,
        ) from None
    except Exception as e:  # the compile failed: the grammar is unusable
        raise bad_request(
            f"{params.param}: the grammar could not be compiled: {e}", param=params.param
        ) from None
    finally:
        release()
