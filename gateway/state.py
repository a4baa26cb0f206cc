"""What the gateway serves now. A reload builds a new ``Serving`` and swaps it in whole; a request takes the one
current when it arrives and keeps it to the end, so it finishes on the fleet (and replica) it started on."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from gateway.config import ConfigError, GatewayConfig
from gateway.fleet.discovery import Discovered, with_replicas
from gateway.fleet.fleet import Fleet
from gateway.fleet.host_scrape import HostScrapes
from gateway.residency.signal import NO_SIGNAL, Signal
from gateway.residency.store import ResidencyStore
from gateway.tenants.admission import Admission
from gateway.tenants.directory import TenantDirectory
from gateway.tenants.registry import Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Serving:
    config: GatewayConfig
    tenants: TenantDirectory
    fleet: Fleet


class GatewayState:
    def __init__(
        self, config: GatewayConfig, config_path: Path | None, admission: Admission, registry: Registry
    ) -> None:
        # The config file's, and the one served: the file's merged with the tenants and keys changed at run time.
        self.base_config = config
        self.config = config
        # What the process was started with: the settings a reload cannot apply keep these values (gateway/reload.py).
        self.started_config = config
        # What DNS said last for the pools that discover their replicas.
        self.discovered: Discovered = {}
        self.config_path = config_path
        self.registry = registry
        # One residency record for the app's lifetime, shared by the fleets a reload swaps.
        self.residency_store: ResidencyStore | None = None
        # Under serve --workers: this worker's part in scraping the engines once per host (every fleet's).
        self.scrapes: HostScrapes | None = None
        # And the residency record's slot releases across gateways (gateway/residency/signal.py), kept the same way.
        self.slot_signal: Signal = NO_SIGNAL
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

    def compose(
        self, base: GatewayConfig, discovered: Discovered | None = None, *, lenient: bool = False
    ) -> GatewayConfig:
        """What to serve for a config file: DNS's replicas in, run-time tenants and keys merged; may raise
        ``ConfigError`` (``lenient``: only when the file itself is at fault)."""
        with_dns = with_replicas(base, self.discovered if discovered is None else discovered)
        return self.registry.state.merged(with_dns, lenient=lenient)

    def swap(
        self, serving: Serving, base_config: GatewayConfig | None = None, discovered: Discovered | None = None
    ) -> Serving | None:
        previous, self._serving = self._serving, serving
        if base_config is not None:
            self.base_config = base_config
        if discovered is not None:
            self.discovered = discovered
        self.config = serving.config
        self.admission.configure(serving.config)
        return previous

    def refresh_tenants(self) -> None:
        """Serve the tenants and keys the registry holds now (called on each change it applies)."""
        if self._serving is None:
            return
        try:
            config = self.compose(self.base_config, lenient=True)
        except ConfigError as exc:  # e.g. a run-time tenant names an adapter a reload removed
            log.error("tenant registry change not applied: %s", exc)
            return
        self.swap(Serving(config, TenantDirectory(config), self._serving.fleet))
