"""What the gateway serves now. A reload builds a new ``Serving`` and swaps it in whole; a request takes the one
current when it arrives and keeps it to the end, so it finishes on the fleet (and replica) it started on."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gateway.admission import Admission
from gateway.config import GatewayConfig
from gateway.fleet import Fleet
from gateway.tenancy import TenantDirectory


@dataclass(frozen=True)
class Serving:
    config: GatewayConfig
    tenants: TenantDirectory
    fleet: Fleet


class GatewayState:
    def __init__(self, config: GatewayConfig, config_path: Path | None, admission: Admission) -> None:
        self.config = config
        self.config_path = config_path
        # Kept across reloads: a tenant whose limits did not change keeps its buckets.
        self.admission = admission
        admission.configure(config)
        self._serving: Serving | None = None
        # Set on SIGTERM: /readyz fails so load balancers stop sending, while in-flight requests finish.
        self.draining = False

    @property
    def serving(self) -> Serving:
        if self._serving is None:
            raise RuntimeError("the gateway has not started")
        return self._serving

    @property
    def started(self) -> bool:
        return self._serving is not None

    def swap(self, serving: Serving) -> Serving | None:
        previous, self._serving = self._serving, serving
        self.config = serving.config
        self.admission.configure(serving.config)
        return previous
