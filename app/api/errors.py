"""OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}`` and the status codes."""

from __future__ import annotations

from pydantic import ValidationError


class APIError(Exception):
    """An error the client should see as-is: status code plus OpenAI's error body."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Incorrect API key provided.", type="authentication_error", code="invalid_api_key")


def too_large(limit_bytes: int) -> APIError:
    return APIError(413, f"Request body exceeds {limit_bytes} bytes.", code="request_too_large")


def overloaded(retry_after_s: int, tier: str, why: str = "is at its queue limit") -> APIError:
    return APIError(429, f"The {tier} pool {why}; retry after {retry_after_s} s.",
                    type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry_after_s)})


def shutting_down(retry_after_s: int) -> APIError:
    return APIError(503, f"This server is shutting down; retry after {retry_after_s} s.", type="server_error",
                    code="service_unavailable", headers={"Retry-After": str(retry_after_s)})


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="service_unavailable")


def from_validation_error(exc: ValidationError) -> APIError:
    """The first failing field as OpenAI names it (``messages.0.role``), its message, 400."""
    first = exc.errors()[0]
    param = (first.get("ctx") or {}).get("param") or ".".join(str(p) for p in first.get("loc", ()) if p not in ("body",)) or None
    message = first.get("msg", "invalid request")
    message = message.removeprefix("Value error, ")
    return bad_request(f"{message}" + (f" (at {param})" if param else ""), param=param)


def server_error(message: str) -> APIError:
    """500: this request failed inside the engine (the others go on); retrying it may succeed."""
    return APIError(500, message, type="server_error", code="generation_failed")
