"""What each engine failure means, decided once, in one table: may the request be retried on another replica,
what it says of the replica's health (its blame: gateway/fleet/outlier.py counts it, or not, by that), and which
gateway error the client sees.

Drivers raise ``backends.errors``; dispatch (a request's failure) and the admin API (a load or unload an operator
asked for) both read this table. The first row whose type matches wins, so subclasses come before their bases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from backends.errors import (
    AdapterCacheFull,
    AdapterLoadFailed,
    AdapterNotLoaded,
    BackendError,
    DeadlineExceeded,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    StreamBroken,
)
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    UpstreamBusy,
    UpstreamError,
    UpstreamTimeout,
    WorkingSetFull,
)
from gateway.fleet.outlier import Blame


@dataclass(frozen=True, slots=True)
class Verdict:
    # Another replica may succeed where this one failed (only before the client saw a byte).
    retryable: bool
    # What the failure says of the replica: "replica" (it is sick), "suspect" (it may be, or the request caused it:
    # counted only on evidence), "none" (the request's or the tenant's doing). gateway/fleet/outlier.py's rule.
    blame: Blame
    error: GatewayError


@dataclass(frozen=True, slots=True)
class _Rule:
    retryable: Callable[[BackendError], bool]
    blame: Callable[[BackendError, bool], Blame]  # (failure, the deadline was the tenant's own)
    error: Callable[[BackendError], GatewayError]


_NO_ROOM = "The model replica has no room for this adapter now; retry shortly."
_LOST_AGAIN = (
    "The model's adapter was pushed out of its replica again as it was loaded for this request; retry shortly."
)
# Error types an engine's body uses for the client's mistakes (vLLM, OpenAI): never the replica's fault, whatever
# the status says.
_CLIENT_KINDS = frozenset({"BadRequestError", "invalid_request_error", "NotFoundError", "Bad Request"})


def _always(exc: BackendError) -> bool:
    return True


def _never(exc: BackendError) -> bool:
    return False


def _replica(exc: BackendError, tenant_deadline: bool) -> Blame:
    return "replica"


def _nobody(exc: BackendError, tenant_deadline: bool) -> Blame:
    return "none"


def _timeout(exc: BackendError, tenant_deadline: bool) -> Blame:
    """A timeout of the tenant's own (shorter) deadline says nothing of the replica; the pool's may (a stalled
    engine) or may not (a long generation)."""
    return "none" if tenant_deadline else "suspect"


# An engine's or a proxy's "busy": not the request's fault, whatever type the body names.
_BUSY = 429
# The most of an engine's error text passed to the client (and so to the access log): an engine's (or a proxy's)
# page of megabytes went whole into the answer.
ENGINE_MESSAGE_CHARS = 1000


def _engine_fault(exc: BackendError) -> bool:
    """A 5xx the engine does not name as the client's."""
    return isinstance(exc, EngineRejected) and exc.status >= 500 and exc.kind not in _CLIENT_KINDS


def _engine_retryable(exc: BackendError) -> bool:
    return _engine_fault(exc) or (isinstance(exc, EngineRejected) and exc.status == _BUSY)


def _engine_blame(exc: BackendError, tenant_deadline: bool) -> Blame:
    return "suspect" if _engine_fault(exc) else "none"


def _rejected(exc: BackendError) -> GatewayError:
    if isinstance(exc, EngineRejected) and exc.status == _BUSY:
        return UpstreamBusy("The model replica is busy; retry shortly.")
    if isinstance(exc, EngineRejected) and (400 <= exc.status < 500 or exc.kind in _CLIENT_KINDS) and exc.status != 404:
        return InvalidRequest(_bounded(exc.message))  # the engine's own validation, e.g. max_tokens over the context
    return UpstreamError("The model replica failed to answer.")


def _bounded(message: str) -> str:
    if len(message) <= ENGINE_MESSAGE_CHARS:
        return message
    return f"{message[:ENGINE_MESSAGE_CHARS]}... ({len(message):,} characters, cut)"


def _timed_out(exc: BackendError) -> GatewayError:
    return UpstreamTimeout("The model replica did not answer in time.")


def _failed(exc: BackendError) -> GatewayError:
    return UpstreamError("The model replica failed to answer.")


_RULES: tuple[tuple[type[BackendError], _Rule], ...] = (
    # Busy with other adapters, not broken; another replica may have room.
    (AdapterCacheFull, _Rule(_always, _nobody, lambda exc: WorkingSetFull(_NO_ROOM, headers={"Retry-After": "1"}))),
    # Raised only when the adapter was gone again after the gateway loaded it once more for this request (dispatch's
    # ``_adapter_missing``): another gateway sharing the replica's slots pushed it out meanwhile. The engine would
    # serve the request once its adapter stays: slot contention, not a broken replica. Tried once elsewhere, then
    # answered as a full working set is (503, Retry-After), not 502.
    (AdapterNotLoaded, _Rule(_always, _nobody, lambda exc: WorkingSetFull(_LOST_AGAIN, headers={"Retry-After": "1"}))),
    # The request's own deadline passed while it waited (for a load, or before it was sent).
    (DeadlineExceeded, _Rule(_never, _nobody, _timed_out)),
    (EngineTimeout, _Rule(_never, _timeout, _timed_out)),
    (
        EngineUnavailable,
        _Rule(_always, _replica, lambda exc: UpstreamError("The model replica is unavailable; try again.")),
    ),
    (StreamBroken, _Rule(_always, _replica, _failed)),
    (
        AdapterLoadFailed,
        _Rule(_never, _nobody, lambda exc: UpstreamError("The model could not be loaded on its replica.")),
    ),
    # The engine answered with an error status. A 5xx may be the replica's or the request's: tried once elsewhere
    # (which tells the two apart, outlier.py) unless the engine names it the client's; a 4xx is the request's, but
    # a 429 (busy) is tried elsewhere, blaming nobody, and else answered 503 (UpstreamBusy).
    (EngineRejected, _Rule(_engine_retryable, _engine_blame, _rejected)),
    (BackendError, _Rule(_never, _nobody, _failed)),
)


def classify(exc: BackendError, tenant_deadline: bool = False) -> Verdict:
    """The verdict on ``exc``; ``tenant_deadline``: the request ran under the tenant's own, shorter timeout."""
    for kind, rule in _RULES:
        if isinstance(exc, kind):
            return Verdict(rule.retryable(exc), rule.blame(exc, tenant_deadline), rule.error(exc))
    raise AssertionError("BackendError is the last row")  # pragma: no cover


def to_gateway_error(exc: BackendError) -> GatewayError:
    """The error the client sees for ``exc``."""
    return classify(exc).error
