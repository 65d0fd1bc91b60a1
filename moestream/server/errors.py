"""The OpenAI error shape every server module answers with: `ProtocolError` (status, message, offending field) and
its body. A leaf module, so the request validators (protocol, options, structured, tools) share it without import
cycles.
"""
from __future__ import annotations


class ProtocolError(Exception):
    """An OpenAI-shaped error response: HTTP status, message, offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, err_type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.err_type = status, message, param, err_type
        self.code, self.headers = code, headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.err_type, self.param, self.code)


def error_body(message: str, err_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def bad_request(param: str, message: str) -> ProtocolError:
    """A 400 naming the offending field."""
    return ProtocolError(400, message, param)
