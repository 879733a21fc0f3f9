"""API errors, rendered in OpenAI's shape on /v1 and in the Workers-AI envelope on /accounts/.../ai/run."""

from __future__ import annotations

import math
from typing import Any

from fastapi.responses import JSONResponse

# Workers-AI internal codes (https://developers.cloudflare.com/workers-ai/platform/errors/).
WAI_NO_SUCH_MODEL = 5007
WAI_INVALID_INPUT = 3003
WAI_TOO_LARGE = 3006
WAI_ABORTED = 3008
WAI_OUT_OF_CAPACITY = 3040
WAI_AUTH = 10000
WAI_INTERNAL = 3043
# nginx's code for "the client went away before the answer was complete": for logs and metering.
STATUS_CLIENT_CLOSED = 499


class ApiError(Exception):
    """An error answer: HTTP status, message, OpenAI type/code/param and the Workers-AI code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        wai_code: int = WAI_INVALID_INPUT,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.wai_code = wai_code
        self.retry_after = retry_after

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def workers_ai_body(self) -> dict[str, Any]:
        return {
            "result": None,
            "success": False,
            "errors": [{"code": self.wai_code, "message": self.message}],
            "messages": [],
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}

    def body_for(self, path: str) -> dict[str, Any]:
        return self.workers_ai_body() if is_workers_ai_path(path) else self.openai_body()

    def response(self, path: str) -> JSONResponse:
        return JSONResponse(self.body_for(path), status_code=self.status, headers=self.headers())


def is_workers_ai_path(path: str) -> bool:
    return path.startswith("/accounts/") and "/ai/run/" in path


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, type="authentication_error", code="invalid_api_key", wai_code=WAI_AUTH)


def model_not_found(message: str) -> ApiError:
    return ApiError(
        404,
        message,
        type="invalid_request_error",
        code="model_not_found",
        param="model",
        wai_code=WAI_NO_SUCH_MODEL,
    )


def rate_limited(message: str, retry_after: float | None) -> ApiError:
    return ApiError(
        429,
        message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        wai_code=WAI_OUT_OF_CAPACITY,
        retry_after=retry_after,
    )


def busy(message: str, retry_after: float = 1.0) -> ApiError:
    """The model's queue is full, or the client asked not to wait (rejectIfBusy)."""
    return ApiError(
        429, message, type="server_busy", code="3040", wai_code=WAI_OUT_OF_CAPACITY, retry_after=retry_after
    )


def body_too_large(message: str) -> ApiError:
    return ApiError(413, message, code="body_too_large", wai_code=WAI_TOO_LARGE)


def internal(message: str) -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error", wai_code=WAI_INTERNAL)


def unexpected(request_id: str) -> ApiError:
    """A bug on our side: the body names the request id only; the details go to the log."""
    return internal(f"internal error; the server log has the details under request id {request_id}")


def unavailable(message: str, retry_after: float | None = 5.0) -> ApiError:
    return ApiError(
        503,
        message,
        type="service_unavailable",
        code="service_unavailable",
        wai_code=WAI_OUT_OF_CAPACITY,
        retry_after=retry_after,
    )


def upstream_failed(status: int, message: str) -> ApiError:
    """Client errors of an upstream keep their status; its server errors become 502 Bad Gateway."""
    if status == 429:
        return busy(message)
    if 400 <= status < 500:
        return ApiError(status, message)
    return ApiError(502, message, type="server_error", code="upstream_error", wai_code=WAI_INTERNAL)
