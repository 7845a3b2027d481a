"""OpenAI-shaped error responses, as the engine writes them (``{"error": {message, type, param, code}}``)."""

from __future__ import annotations

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "invalid_request_error",
    502: "server_error",
    503: "service_unavailable",
}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   retry_after: int | None = None) -> web.Response:
    body = {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response(body, status=status, headers=headers)
