"""`ApiError`: an HTTP error as the OpenAI API reports it.

Life cycle: raised anywhere while a request is handled (validation, capacity,
engine failure); the error middleware (`shared/openai/http.py`) turns it into
the JSON error object `{"error": {message, type, param, code}}` with its status.
"""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers or {}
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}
