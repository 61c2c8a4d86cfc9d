"""The error envelope on every route: `{"error": {"message", "type", "param", "code"}}` (OpenAI's shape), and
on the Anthropic routes (`/v1/messages...`) Anthropic's `{"type": "error", "error": {"type", "message"}}`.

Bad input is always a 4xx: `RequestError` (raised by validation anywhere) carries its status; FastAPI's
422 validation errors become 400; unknown routes and methods get 404/405 in the envelope; anything
unexpected is a 500 envelope with the exception's class name, logged with its traceback.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.tokenizer.generate_input import RequestError

logger = logging.getLogger(__name__)

__all__ = ["RequestError", "anthropic_error_body", "error_body", "error_response", "envelope",
           "install_error_handlers", "is_anthropic_path", "parse_json", "read_json"]

_STATUS_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Anthropic's error types by HTTP status (its API answers 529 overloaded_error where radixgen answers 503).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 499: "invalid_request_error", 503: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's envelope; it has no `param` field, so the parameter leads the message when the message does
    not already quote it."""
    if param and f"'{param}'" not in message and not message.startswith(param):
        message = f"{param}: {message}"
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def envelope(path: str, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
             code: str | int | None = None) -> dict[str, Any]:
    """The error body for a response on `path`: Anthropic's on its routes, OpenAI's everywhere else."""
    if is_anthropic_path(path):
        return anthropic_error_body(status, message, param)
    return error_body(message, type, param, code)


def error_response(err: RequestError, path: str = "") -> JSONResponse:
    return JSONResponse(envelope(path, err.status, err.message, err.type, err.param, err.code), err.status,
                        headers=err.headers)


def no_reasoning_parser(param: str) -> RequestError:
    """The 400 for a request asking for separated reasoning on a server started without a reasoning parser."""
    return RequestError(f"'{param}' needs a reasoning parser: start the server with --reasoning-parser NAME "
                        "(e.g. qwen3, deepseek-r1)", param, "unsupported_parameter")


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request body as strict JSON, refusing more than `max_bytes` (413) while reading."""
    chunks, seen = [], 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > max_bytes:
            raise RequestError(f"request body larger than {max_bytes} bytes", None, "request_too_large", 413)
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


def parse_json(raw: bytes) -> Any:
    """Strict JSON (no NaN, no lone surrogates, valid UTF-8), else a 400 RequestError."""
    if not raw:
        raise RequestError("the request body is empty; expected a JSON object", None, "invalid_json")
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise RequestError(f"We could not parse the JSON body of your request ({e}).", None,
                           "invalid_json") from None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()[:10]
        first = errs[0] if errs else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        msg = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg', '')}"[:200] for e in errs)
        return JSONResponse(envelope(request.url.path, 400, msg or "invalid request", param=param,
                                     code="invalid_value"), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        kind = _STATUS_TYPES.get(exc.status_code, "invalid_request_error")
        return JSONResponse(envelope(request.url.path, exc.status_code, message, kind, None, code), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(envelope(request.url.path, 500, f"internal error: {type(exc).__name__}", "server_error",
                                     None, "internal_error"), 500)
