"""What one admitted request is, decided once by ingress and only read after it: the frozen context that flows
down to dispatch and relay. Telemetry observes the request separately (its ``RequestRecord``)."""

from __future__ import annotations

from typing import NamedTuple

from backends.base import AdapterRef
from gateway.tenants.directory import Target, Tenant


class RequestContext(NamedTuple):  # immutable, and cheaper to build per request than a frozen dataclass
    tenant: Tenant
    # The model the request runs on: for an A/B split, the variant picked for this end user.
    target: Target
    # The picked variant's name, told to the client in x-tenantgate-variant; None without a split.
    variant: str | None
    # What routing hashes: the tenant, its session, or the adapter (routing.affinity).
    key: str
    # The adapter as the engine knows it; None for the base model.
    adapter: AdapterRef | None
    # The engine's path and the body for it (its ``model`` names the engine's model).
    engine_path: str
    body: bytes
    stream: bool
    # The engine was asked for its usage on a stream whose client did not ask: relay leaves that chunk out.
    strip_usage: bool
    # time.monotonic() by which the request must be answered.
    deadline: float
    # The deadline is the tenant's own, shorter than the pool's: a timeout then says nothing of the replica.
    tenant_deadline: bool
