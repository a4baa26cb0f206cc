"""What each engine failure means, decided once, in one table: may the request be retried on another replica,
does it count against the replica's health, and which gateway error the client sees.

Drivers raise ``backends.errors``; dispatch (a request's failure) and the admin API (a load or unload an operator
asked for) both read this table. The first row whose type matches wins, so subclasses come before their bases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from backends.errors import (
    AdapterCacheFull,
    AdapterLoadFailed,
    BackendError,
    DeadlineExceeded,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    StreamBroken,
)
from gateway.errors import GatewayError, InvalidRequest, UpstreamError, UpstreamTimeout, WorkingSetFull


@dataclass(frozen=True, slots=True)
class Verdict:
    # Another replica may succeed where this one failed (only before the client saw a byte).
    retryable: bool
    # The failure says the replica is sick: it counts toward outlier ejection. A rule that needs the outcome of
    # the retry (the same request succeeding elsewhere) would decide this after the retry, in dispatch.
    replica_fault: bool
    error: GatewayError


@dataclass(frozen=True, slots=True)
class _Rule:
    retryable: Callable[[BackendError], bool]
    replica_fault: Callable[[BackendError, bool], bool]  # (failure, the deadline was the tenant's own)
    error: Callable[[BackendError], GatewayError]


_NO_ROOM = "The model replica has no room for this adapter now; retry shortly."


def _always(exc: BackendError, tenant_deadline: bool = False) -> bool:
    return True


def _never(exc: BackendError, tenant_deadline: bool = False) -> bool:
    return False


def _unless_tenant_deadline(exc: BackendError, tenant_deadline: bool) -> bool:
    """A timeout of the tenant's own (shorter) deadline says nothing of the replica."""
    return not tenant_deadline


def _status(exc: BackendError) -> int:
    return exc.status if isinstance(exc, EngineRejected) else 0


def _rejected(exc: BackendError) -> GatewayError:
    if isinstance(exc, EngineRejected) and 400 <= exc.status < 500 and exc.status != 404:
        return InvalidRequest(exc.message)  # the engine's own validation, e.g. max_tokens over the context
    return UpstreamError("The model replica failed to answer.")


def _timed_out(exc: BackendError) -> GatewayError:
    return UpstreamTimeout("The model replica did not answer in time.")


def _failed(exc: BackendError) -> GatewayError:
    return UpstreamError("The model replica failed to answer.")


_RULES: tuple[tuple[type[BackendError], _Rule], ...] = (
    # Busy with other adapters, not broken; another replica may have room.
    (AdapterCacheFull, _Rule(_always, _never, lambda exc: WorkingSetFull(_NO_ROOM, headers={"Retry-After": "1"}))),
    # The request's own deadline passed while it waited (for a load, or before it was sent).
    (DeadlineExceeded, _Rule(_never, _never, _timed_out)),
    (EngineTimeout, _Rule(_never, _unless_tenant_deadline, _timed_out)),
    (
        EngineUnavailable,
        _Rule(_always, _always, lambda exc: UpstreamError("The model replica is unavailable; try again.")),
    ),
    (StreamBroken, _Rule(_always, _always, _failed)),
    (
        AdapterLoadFailed,
        _Rule(_never, _never, lambda exc: UpstreamError("The model could not be loaded on its replica.")),
    ),
    # The engine answered with an error status: a 5xx is the replica's, a 503 says "elsewhere", a 4xx the request's.
    (
        EngineRejected,
        _Rule(lambda exc: _status(exc) == 503, lambda exc, _: _status(exc) >= 500, _rejected),
    ),
    (BackendError, _Rule(_never, _never, _failed)),
)


def classify(exc: BackendError, tenant_deadline: bool = False) -> Verdict:
    """The verdict on ``exc``; ``tenant_deadline``: the request ran under the tenant's own, shorter timeout."""
    for kind, rule in _RULES:
        if isinstance(exc, kind):
            return Verdict(rule.retryable(exc), rule.replica_fault(exc, tenant_deadline), rule.error(exc))
    raise AssertionError("BackendError is the last row")  # pragma: no cover


def to_gateway_error(exc: BackendError) -> GatewayError:
    """The error the client sees for ``exc``."""
    return classify(exc).error
