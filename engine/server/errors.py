"""The server's one error: an OpenAI-shaped error body with its HTTP status and headers.

Whatever refuses a request (the serving logic, auth, the admin API, request validation) raises
``ApiError``; the app's exception handler renders it (api_server.py), and middleware, which runs
outside the handlers, returns ``error.response()`` itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse

from kvpilot.engine.server import protocol as p

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
