"""What each engine failure means: retry elsewhere?, counts against the replica?, what the client sees
(gateway/failures.py, the one table dispatch and the admin API read)."""

from __future__ import annotations

import pytest

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
from gateway.failures import classify


@pytest.mark.parametrize(
    ("error", "retryable", "replica_fault", "status"),
    [
        pytest.param(EngineUnavailable("refused"), True, True, 502, id="unreachable"),
        pytest.param(EngineTimeout("slow"), False, True, 504, id="timeout"),
        pytest.param(DeadlineExceeded("the request's own deadline"), False, False, 504, id="own-deadline"),
        pytest.param(StreamBroken("cut"), True, True, 502, id="stream-cut"),
        pytest.param(EngineRejected(500, "crashed"), False, True, 502, id="engine-500"),
        pytest.param(EngineRejected(503, "overloaded"), True, True, 502, id="engine-503"),
        pytest.param(EngineRejected(400, "prompt too long"), False, False, 400, id="engine-400"),
        pytest.param(EngineRejected(404, "no such model"), False, False, 502, id="engine-404"),
        # A full PEFT cache is load from other adapters, not a broken replica: no ejection, but try elsewhere.
        pytest.param(AdapterCacheFull(503, "Cache is full"), True, False, 503, id="cache-full"),
        pytest.param(AdapterNotLoaded(404, "unknown adapter"), False, False, 502, id="adapter-gone-twice"),
        pytest.param(AdapterLoadFailed("a1", 400, "bad weights"), False, False, 502, id="load-failed"),
        pytest.param(BackendError("anything else"), False, False, 502, id="other"),
    ],
)
def test_what_each_failure_means(error: BackendError, retryable: bool, replica_fault: bool, status: int) -> None:
    verdict = classify(error)
    assert (verdict.retryable, verdict.replica_fault, verdict.error.status) == (retryable, replica_fault, status)


def test_an_engine_400_passes_its_own_message_to_the_client() -> None:
    assert classify(EngineRejected(400, "max_tokens is over the context")).error.message == (
        "max_tokens is over the context"
    )


def test_a_tenants_own_deadline_does_not_count_against_the_replica() -> None:
    assert classify(EngineTimeout("the tenant's 2 s"), tenant_deadline=True).replica_fault is False
    assert classify(EngineTimeout("the pool's timeout"), tenant_deadline=False).replica_fault is True
    assert classify(StreamBroken("cut"), tenant_deadline=True).replica_fault is True
