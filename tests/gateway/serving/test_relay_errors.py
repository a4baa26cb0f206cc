"""How engine failures count against a replica and what the client sees (gateway/serving/relay.py)."""

from __future__ import annotations

import pytest

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
from gateway.serving.relay import _counts_against_replica, _replica_fault, to_gateway_error


@pytest.mark.parametrize(
    ("error", "replica_fault", "status"),
    [
        (EngineUnavailable("refused"), True, 502),
        (EngineTimeout("slow"), True, 504),
        (DeadlineExceeded("the request's own deadline"), False, 504),
        (StreamBroken("cut"), True, 502),
        (EngineRejected(500, "crashed"), True, 502),
        (EngineRejected(400, "prompt too long"), False, 400),
        # A full PEFT cache is load from other adapters, not a broken replica: no ejection for it.
        (AdapterCacheFull(503, "Cache is full"), False, 503),
        (AdapterLoadFailed("a1", 400, "bad weights"), False, 502),
    ],
)
def test_what_counts_against_a_replica(error: BackendError, replica_fault: bool, status: int) -> None:
    assert _replica_fault(error) is replica_fault
    assert to_gateway_error(error).status == status


def test_a_tenants_own_deadline_does_not_count_against_the_replica() -> None:
    assert _counts_against_replica(EngineTimeout("the tenant's 2 s"), tenant_deadline=True) is False
    assert _counts_against_replica(EngineTimeout("the pool's timeout"), tenant_deadline=False) is True
    assert _counts_against_replica(StreamBroken("cut"), tenant_deadline=True) is True
