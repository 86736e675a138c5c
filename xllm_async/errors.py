"""Errors as values: a status code and an OpenAI-style body, rendered in one place."""

from __future__ import annotations

import orjson

_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
    408: "RequestTimeoutError", 413: "RequestTooLargeError", 431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError", 503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """Raised anywhere a request cannot be answered normally; becomes
    {"error": {"message", "type", "param", "code"}} with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers  # extra response header lines, e.g. retry-after

    def body(self) -> bytes:
        return orjson.dumps({"error": self.as_dict()})

    def as_dict(self) -> dict:
        return {"message": self.message, "type": _TYPES.get(self.status, "Error"),
                "param": self.param, "code": self.status}
