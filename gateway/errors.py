"""One error tree for everything the gateway answers with, rendered as OpenAI error bodies.

Each class knows its HTTP status, its OpenAI ``type`` and ``code``. Drivers raise ``backends.errors`` and the
relay maps them here at the boundary, ``from`` the engine's error.
"""

from __future__ import annotations

import json
from typing import ClassVar

from aiohttp import web


class GatewayError(Exception):
    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)

    def sse_event(self) -> bytes:
        """The final event of a stream that broke after its first byte: never a second response."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\ndata: [DONE]\n\n"


class InvalidRequest(GatewayError):
    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class AuthenticationFailed(GatewayError):
    status = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFound(GatewayError):
    """Also what a tenant gets for another tenant's adapter: existence is not leaked."""

    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


class RouteNotFound(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(GatewayError):
    status = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"


class HeaderFieldsTooLarge(GatewayError):
    status = 431
    error_type = "invalid_request_error"
    code = "request_header_fields_too_large"


class NoHealthyReplica(GatewayError):
    status = 503
    error_type = "server_error"
    code = "no_healthy_replica"


class WorkingSetFull(GatewayError):
    """Every adapter resident on the chosen replica is pinned or in use, or another gateway's load there did not
    end in time: nothing could make room for this one. Retrying shortly usually finds room."""

    status = 503
    error_type = "server_error"
    code = "adapter_capacity_exhausted"


class RequestRateLimited(GatewayError):
    status = 429
    error_type = "requests"
    code = "rate_limit_exceeded"


class TokenRateLimited(GatewayError):
    status = 429
    error_type = "tokens"
    code = "rate_limit_exceeded"


class Overloaded(GatewayError):
    """The gateway's bound on work in flight is reached: refused at once rather than queued without bound."""

    status = 503
    error_type = "server_error"
    code = "overloaded"


class StoreUnreachable(GatewayError):
    """An admin change every gateway must hear of (a drain, a placement pin or freeze) was not made: the shared store
    (Redis) does not answer. The server's trouble, not the request's: retry once it is back."""

    status = 503
    error_type = "server_error"
    code = "store_unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Retry-After": "5"})


class UpstreamError(GatewayError):
    status = 502
    error_type = "server_error"
    code = "upstream_error"


class UpstreamBusy(GatewayError):
    """The replica (or a proxy before it) said it is busy (429) and no other took the request: the request is fine,
    try again shortly. The Retry-After is the gateway's own: an engine's header is never passed through."""

    status = 503
    error_type = "server_error"
    code = "upstream_busy"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"Retry-After": "1"})


class UpstreamTimeout(GatewayError):
    status = 504
    error_type = "server_error"
    code = "upstream_timeout"


class AdminDisabled(GatewayError):
    status = 404
    error_type = "invalid_request_error"
    code = "not_found"
