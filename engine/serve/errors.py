"""`ApiError`: an HTTP error status with OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`.

Every request the server refuses becomes one of these; the message is one line that names the field or
value and says why, as everywhere in Slipstream.
"""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(" ".join(str(message).split()))
        self.status = status
        self.type = type_
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    @property
    def message(self) -> str:
        return str(self)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    """The client hung up (while sending, while queued, or mid-generation): nothing more to send."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
