"""The server's one error: an OpenAI-shaped error body with its HTTP status and headers.

Whatever refuses a request (the serving logic, auth, the admin API) raises ``ApiError``; the app's
exception handlers (``EXCEPTION_HANDLERS``) render it, and turn FastAPI's own errors (a body that
fails validation, an unknown path) and unexpected ones into it too. Middleware, which runs outside
the handlers, returns ``error.response()`` itself.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from kvpilot.engine.server import protocol as p

logger = logging.getLogger(__name__)

# Seconds a client refused with 429 or 503 should wait; one engine step is well below it.
RETRY_AFTER_S = 1

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """A failed request, as OpenAI reports one: ``{"error": {message, type, param, code}}``.

    The type follows from the status unless given; 429 and 503 tell the client when to retry
    (Retry-After), 401 which scheme to authenticate with (WWW-Authenticate).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = error_type or _TYPE_BY_STATUS.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if status in (429, 503):
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))
        elif status == 401:
            self.headers.setdefault("WWW-Authenticate", "Bearer")

    @property
    def body(self) -> p.ErrorResponse:
        info = p.ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return p.ErrorResponse(error=info)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body.model_dump(), status_code=self.status, headers=self.headers)


def param_from_message(message: str, candidates: Sequence[str]) -> str | None:
    """The field a validation message is about: its first word if that is a field
    (``"stop[0] must be ..."``, ``"temperature: ..."``), else the first field it mentions."""
    first = re.split(r"[\s:(]", message.strip(), maxsplit=1)[0]
    if first.split("[")[0] in candidates:
        return first
    mentions = [
        (match.start(), name)
        for name in candidates
        if (match := re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", message)) is not None
    ]
    return min(mentions)[1] if mentions else None


# What a whole body that is not a JSON object of fields fails with (a model validator's errors sit there too).
_NOT_AN_OBJECT = ("missing", "model_type", "model_attributes_type", "dict_type")

_REQUEST_FIELDS = tuple(
    sorted(
        set(p.CompletionRequest.model_fields) | set(p.ChatCompletionRequest.model_fields)
        | set(p.SchedulerLimitsUpdate.model_fields),
        key=len,
        reverse=True,
    )
)


def _validation_param(loc: tuple[int | str, ...], message: str) -> str | None:
    parts = [str(part) for part in loc if part != "body"]
    # Union members show up as their type name in the location ("str", "list[int]"); drop them.
    parts = [part for part in parts if not any(ch in part for ch in "[]") and part not in ("str", "int", "float")]
    if parts:
        param = parts[0]
        for part in parts[1:]:
            param += f"[{part}]" if part.isdigit() else f".{part}"
        return param
    return param_from_message(message, _REQUEST_FIELDS)


async def _api_error(_: Request, exc: ApiError) -> Response:
    return exc.response()


async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
    first = exc.errors()[0]
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    param = _validation_param(tuple(first.get("loc", ())), message)
    if first.get("type") == "json_invalid":
        message, param = "The request body is not valid JSON.", None
    elif tuple(first.get("loc", ())) == ("body",) and first.get("type") in _NOT_AN_OBJECT:
        message, param = ("The request body must be a JSON object of the request's fields, sent with "
                          "`Content-Type: application/json`."), None
    elif first.get("type") == "missing":
        message = f"{param}: this field is required"
    elif param and not message.startswith(param.split("[")[0].split(".")[0] + ":"):
        message = f"{param}: {message}"
    return ApiError(400, message, param=param).response()


async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
    return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response()


async def _unexpected_error(_: Request, exc: Exception) -> Response:
    logger.exception("unhandled error")
    return ApiError(500, f"Internal server error: {exc!r}").response()


EXCEPTION_HANDLERS = {
    ApiError: _api_error,
    RequestValidationError: _validation_error,
    StarletteHTTPException: _http_error,
    Exception: _unexpected_error,
}
