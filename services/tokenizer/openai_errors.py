"""Errors of the OpenAI-compatible API and the body OpenAI clients expect for them."""

from __future__ import annotations

from typing import Any

# OpenAI's error `type` by HTTP status; any other 4xx is an invalid request, 5xx a server error.
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


class OpenAIError(Exception):
    """A request the API refuses; `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


def error_type(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    """The JSON body of an error answer (also the payload of an error event in a stream)."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": None}}
