"""Errors a driver raises at the engine boundary; the gateway maps them to HTTP (gateway/serving/relay.py)."""

from __future__ import annotations


class BackendError(Exception):
    """Something went wrong talking to one engine replica."""


class EngineUnavailable(BackendError):
    """The replica could not be reached (connect refused, reset, DNS): safe to try another replica."""


class EngineTimeout(BackendError):
    """The replica did not answer in time."""


class DeadlineExceeded(EngineTimeout):
    """The request's own deadline passed while it waited (for an adapter load, or before it was sent): a 504 for
    the client, but nothing against the replica's health."""


class EngineRejected(BackendError):
    """The engine answered with an error status; ``message`` is the engine's own text, ``kind`` the error type its
    body names ("" when it names none), e.g. vLLM's ``BadRequestError``: whose fault the engine says it is."""

    def __init__(self, status: int, message: str, kind: str = "") -> None:
        super().__init__(f"engine answered {status}: {message}")
        self.status = status
        self.message = message
        self.kind = kind


class AdapterNotLoaded(EngineRejected):
    """The engine does not know the adapter (it restarted, or someone unloaded it): load it again."""


class AdapterCacheFull(EngineRejected):
    """The engine has no room for another adapter now (every cached one has requests in flight): another replica
    may have; status 503."""


class AdapterLoadFailed(BackendError):
    """The engine refused to load an adapter (bad path, rank above its limit, ...)."""

    def __init__(self, adapter: str, status: int, message: str) -> None:
        super().__init__(f"loading adapter {adapter!r} failed ({status}): {message}")
        self.adapter = adapter
        self.status = status
        self.message = message


class StreamBroken(BackendError):
    """The engine's stream ended abnormally after it had started (the connection dropped or reset). A stream that
    runs past its timeout raises ``EngineTimeout`` instead: a long generation is not a broken replica."""
