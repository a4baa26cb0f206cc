"""Triton's error kinds, and how each one shows on the wire: a gRPC status for unary RPCs, an HTTP status with
``{"error": message}`` for the HTTP endpoint, and only the message (``error_message``) inside a stream.

The mappings are Triton's own (server ``src/grpc/grpc_utils.cc`` and ``src/http_server.cc`` ``HttpCodeFromError``).
"""

from __future__ import annotations

import enum

import grpc


class Kind(enum.Enum):
    INVALID_ARG = (grpc.StatusCode.INVALID_ARGUMENT, 400)
    NOT_FOUND = (grpc.StatusCode.NOT_FOUND, 404)
    UNSUPPORTED = (grpc.StatusCode.UNIMPLEMENTED, 501)
    UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, 503)
    INTERNAL = (grpc.StatusCode.INTERNAL, 500)

    @property
    def grpc_code(self) -> grpc.StatusCode:
        code: grpc.StatusCode = self.value[0]
        return code

    @property
    def http_status(self) -> int:
        status: int = self.value[1]
        return status


class TritonError(Exception):
    def __init__(self, message: str, kind: Kind = Kind.INVALID_ARG) -> None:
        super().__init__(message)
        self.kind = kind


def unknown_model(name: str, version: str = "") -> TritonError:
    at = f" version {version}" if version else ""
    return TritonError(f"Request for unknown model: '{name}'{at} is not found", Kind.NOT_FOUND)


def decoupled_refused(endpoint: str) -> TritonError:
    """What Triton answers when a decoupled model is called on an endpoint that returns one response."""
    return TritonError(f"{endpoint} doesn't support models with decoupled transaction policy", Kind.UNSUPPORTED)
