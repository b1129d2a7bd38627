"""The training server's refusals: an HTTP status, a message that says what to do, and a code, answered in
the OpenAI error shape."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class Refused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def error_response(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": code, "code": code}}, status_code=status)
