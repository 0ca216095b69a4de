"""Every failure as OpenAI shapes it: `{"error": {"message", "type", "param", "code"}}`.

Bad input of any kind is a 400 naming the parameter; a 5xx means the server itself failed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException

from tokenmill.engine.async_engine import EngineDeadError, EngineStepError
from tokenmill.engine.intake import PromptTooLongError
from tokenmill.entrypoints.http.transport.body_checks import InvalidBodyError
from tokenmill.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)

# Error types as OpenAI names them.
INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"


# The error object of OpenAI's published schema. Every route but Anthropic's answers with it,
# the transport's own refusals (413, 503) included, so it lives here rather than with one
# protocol; strict as the protocols' replies are. (No docstrings: /openapi.json would show them.)
class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    model_config = ConfigDict(extra="forbid")

    error: ErrorInfo


class OpenAIError(Exception):
    """An error answered with its own status and OpenAI's error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, INVALID_REQUEST, param, code)


def model_not_found(model: str, served: list[str]) -> OpenAIError:
    """A model this server does not serve: 404 `model_not_found`, as OpenAI and vLLM answer
    (the openai client raises `NotFoundError`)."""
    message = f"The model `{model}` does not exist. This server serves {served}."
    return OpenAIError(404, message, INVALID_REQUEST, param="model", code="model_not_found")


def context_length_error(
    num_prompt_tokens: int,
    max_tokens: int | None,
    max_model_len: int,
    param: str,
    input_param: str | None = None,
) -> OpenAIError:
    """vLLM's wording, which clients and harnesses match on, naming the input as the endpoint
    calls it (`prompt` or `messages`; by default `param` itself)."""
    input_name = input_param or param
    if max_tokens is None:
        detail = f"However, your request has {num_prompt_tokens} input tokens."
    else:
        detail = (
            f"However, you requested {num_prompt_tokens + max_tokens} tokens "
            f"({num_prompt_tokens} in the {input_name}, {max_tokens} in the completion)."
        )
    message = (
        f"This model's maximum context length is {max_model_len} tokens. {detail} "
        f"Please reduce the length of the {input_name} or completion."
    )
    return bad_request(message, param=param, code="context_length_exceeded")


def error_info(error: BaseException) -> tuple[int, ErrorInfo]:
    """The status and error body for any exception a request can end with."""
    if isinstance(error, OpenAIError):
        return error.status_code, error.info
    if isinstance(error, PromptTooLongError):  # the engine's intake: the prompt alone
        too_long = context_length_error(error.num_tokens, None, error.max_model_len, error.param)
        return too_long.status_code, too_long.info
    if isinstance(error, InvalidRequestError):
        return 400, ErrorInfo(message=str(error), type=INVALID_REQUEST, param=error.param)
    if isinstance(error, EngineDeadError):
        return 503, ErrorInfo(message=str(error), type=SERVER_ERROR, code="engine_dead")
    if isinstance(error, EngineStepError):
        return 500, ErrorInfo(message=str(error), type=SERVER_ERROR, code="engine_step_failed")
    return 500, ErrorInfo(message="internal server error", type=SERVER_ERROR)


def error_response(error: BaseException) -> JSONResponse:
    status, info = error_info(error)
    headers = error.headers if isinstance(error, OpenAIError) else None
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)


def error_event(error: BaseException) -> str:
    """An error inside a stream that has already answered 200: one SSE event."""
    _, info = error_info(error)
    return f"data: {ErrorResponse(error=info).model_dump_json()}\n\n"


# Told of each request body refused before it reached the engine (bad input): a decode
# instance lets go of the prefill's KV its `kv_transfer_params` point at (`refused_body`).
RefusedBody = Callable[[Any], None]


def install_error_handlers(app: FastAPI, on_refused: RefusedBody | None = None) -> None:
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        if on_refused is not None:
            on_refused(error.body)
        return _validation_error(error)

    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    for error_type in (OpenAIError, InvalidRequestError, EngineDeadError, EngineStepError):
        app.add_exception_handler(error_type, _known_error)
    app.add_exception_handler(Exception, _unexpected_error)


async def _known_error(request: Request, error: Exception) -> JSONResponse:
    log_server_error(error, f"{request.method} {request.url.path}")
    return error_response(error)


async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    log_server_error(error, f"{request.method} {request.url.path}")
    return error_response(error)


def log_server_error(error: BaseException, where: str) -> None:
    """Every 500 is logged with its traceback (a client sees only "internal server error"); a
    client's mistake (4xx) or a stopped engine (503) is not the server failing."""
    if error_info(error)[0] == 500:
        logger.error("server error in %s", where, exc_info=error)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    if isinstance(error.detail, OpenAIError):  # raised where only HTTPException gets through
        return error_response(error.detail)
    if error.status_code == 404:
        message, type = f"Not found: {request.method} {request.url.path}", NOT_FOUND
    else:
        message, type = str(error.detail), INVALID_REQUEST
    response = error_response(OpenAIError(error.status_code, message, type))
    response.headers.update(error.headers or {})
    return response


@contextlib.contextmanager
def refused_body(on_refused: RefusedBody, body: Any) -> Iterator[None]:
    """Tell `on_refused` of `body` if what runs inside raises a client error (4xx): bad input
    found before the request was queued. (A server error may come after it was queued, when
    the engine has dealt with it already.)"""
    try:
        yield
    except Exception as e:
        if error_info(e)[0] < 500:
            on_refused(body)
        raise


def _validation_error(error: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400, naming the offending field as `param`."""
    errors = error.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return error_response(bad_request(f"Invalid JSON body: {_json_problem(errors)}"))
    body_error = _body_error(errors)
    if body_error is not None:
        return error_response(bad_request(str(body_error), param=body_error.param or None))
    locations = [_location(e) for e in errors]
    messages = [
        f"{'.'.join(loc) or 'body'}: {e.get('msg', 'invalid')}" for loc, e in zip(locations, errors)
    ]
    return error_response(bad_request("; ".join(messages[:4]), param=_param(locations)))


def _body_error(errors: list[dict[str, Any]]) -> InvalidBodyError | None:
    """A check on the whole body (body_checks.py) names its field itself."""
    for e in errors:
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, InvalidBodyError):
            return cause
    return None


def _location(error: dict[str, Any]) -> list[str]:
    loc = [str(part) for part in error.get("loc", ())]
    return loc[1:] if loc and loc[0] in ("body", "query", "path") else loc


def _param(locations: list[list[str]]) -> str | None:
    """The first failing field. A union's members fail separately, each at the field plus a
    member name ("prompt.str", "prompt.list[int]"): their common prefix is the field."""
    if not locations or not locations[0]:
        return None
    prefix = locations[0]
    for loc in locations[1:]:
        if loc[:1] == prefix[:1]:
            pairs = itertools.takewhile(lambda pair: pair[0] == pair[1], zip(prefix, loc))
            prefix = [part for part, _ in pairs]
    return ".".join(prefix) or None


def _json_problem(errors: list[dict[str, Any]]) -> str:
    context = errors[0].get("ctx") or {}
    return str(context.get("error", "could not be parsed"))
