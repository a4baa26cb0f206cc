"""Config reload (SIGHUP or ``POST /admin/reload``): re-read the file, build and warm a new fleet beside the old
one, swap it in whole, and retire the old one once its in-flight requests have finished.

A config that does not load is refused whole (the old one keeps serving). Settings bound to the running process
(listen address, body size limit, tracing, admin token variable) cannot change without a restart: a reload applies the
rest and reports them as warnings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.appkeys import METRICS, STATE
from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.errors import InvalidRequest
from gateway.fleet.discovery import Discovered, discover
from gateway.fleet.fleet import Fleet
from gateway.state import Serving
from gateway.tenants.directory import TenantDirectory

log = logging.getLogger(__name__)

_RESTART_ONLY = ("listen", "admin")


@dataclass
class ReloadResult:
    pools: list[str]
    warnings: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"status": "reloaded", "pools": self.pools, "warnings": self.warnings}


class ReloadRefused(InvalidRequest):
    """The new config does not load; the old one keeps serving."""


_lock = asyncio.Lock()
_retiring: set[asyncio.Task[None]] = set()


async def reload(app: web.Application) -> ReloadResult:
    state = app[STATE]
    if state.config_path is None:
        raise ReloadRefused("This gateway was not started from a config file; there is nothing to reload.")
    async with _lock:
        try:
            base = load_config(state.config_path)
            discovered = await discover(base, state.discovered)
            config = state.compose(base, discovered)  # with DNS's replicas and the run-time tenants and keys
        except Exception as exc:  # ConfigError, or anything else: the old config keeps serving
            problems = getattr(exc, "problems", [str(exc)])
            raise ReloadRefused(
                "The new config was refused; the old one keeps serving: " + "; ".join(problems)
            ) from exc
        warnings = _restart_only_changes(state.config, config)
        await _rebuild(app, config, base, discovered)
    for warning in warnings:
        log.warning("reload: %s", warning)
    log.info("config reloaded from %s: pools %s", state.config_path, sorted(config.pools_by_name))
    return ReloadResult(sorted(config.pools_by_name), warnings)


async def rediscover(app: web.Application) -> None:
    """Re-resolve the discovery pools; when DNS names other replicas, rebuild as a reload would."""
    state = app[STATE]
    async with _lock:
        discovered = await discover(state.base_config, state.discovered)
        if discovered == state.discovered:
            return
        log.info("discovery: replicas changed: %s", {p: [r.id for r in rs] for p, rs in discovered.items()})
        try:
            config = state.compose(state.base_config, discovered)
        except ConfigError as exc:
            log.error("discovery: the replicas found do not make a valid config: %s", exc)
            return
        await _rebuild(app, config, state.base_config, discovered)


async def _rebuild(app: web.Application, config: GatewayConfig, base: GatewayConfig, discovered: Discovered) -> None:
    """Build and warm a fleet for ``config`` beside the serving one, swap it in, retire the old one."""
    state = app[STATE]
    fleet = Fleet(config, app[METRICS], store=state.residency_store, homes_from=base)
    try:
        await fleet.start()
        await fleet.started_up()
    except BaseException:  # refused or cancelled: the new fleet must not run on beside the serving one
        await fleet.close()
        raise
    # The tenants and keys as the registry holds them now: a change (a revocation) may have come in meanwhile.
    config = state.compose(base, discovered, lenient=True)
    old = state.swap(Serving(config, TenantDirectory(config), fleet), base_config=base, discovered=discovered)
    if old is not None:
        old.fleet.stop_background()  # one fleet manages the replicas; the old one only finishes its requests
        task = asyncio.create_task(_retire(old.fleet, config.shutdown.drain_timeout_s), name="retire old fleet")
        _retiring.add(task)
        task.add_done_callback(_retiring.discard)


async def close_retiring() -> None:
    """At shutdown: the fleets still finishing requests after a reload are closed too."""
    for task in list(_retiring):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _restart_only_changes(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    changed = [name for name in _RESTART_ONLY if getattr(old, name) != getattr(new, name)]
    if old.limits.max_body_bytes != new.limits.max_body_bytes:  # aiohttp fixes it when the app is built
        changed.append("limits.max_body_bytes")
    if old.telemetry.tracing != new.telemetry.tracing:
        changed.append("telemetry.tracing")
    return [f"{name} changed but applies only after a restart" for name in changed]


async def _retire(fleet: Fleet, drain_timeout_s: float) -> None:
    """Close the old fleet once its requests are done (they finish on the replicas they started on)."""
    try:
        if not await fleet.drained(drain_timeout_s):
            log.warning("closing the old fleet with %d requests still in flight", fleet.in_flight)
    finally:
        with contextlib.suppress(Exception):
            await fleet.close(close_store=False)


async def admin_reload(request: web.Request) -> web.Response:
    # Shielded: an admin client that gives up must not cancel a rebuild half-way.
    result = await asyncio.shield(reload(request.app))
    return web.json_response(result.as_json())
