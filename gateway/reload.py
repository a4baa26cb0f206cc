"""Config reload (SIGHUP or ``POST /admin/reload``): re-read the file, build and warm a new fleet beside the old
one, swap it in whole, and retire the old one once its in-flight requests have finished.

With Redis, ``POST /admin/reload`` reloads every gateway sharing it (gateway/reload_fanout.py); SIGHUP reloads this
one. A config that does not load is refused whole (the old one keeps serving). Settings bound to the running process
(``RESTART_ONLY``) cannot change without a restart: a reload applies the rest and names each of these that the file
changes, in its answer (``restart_required``), a warning in the log and ``tenantgate_config_restart_pending``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.admin.drains import DRAINS
from gateway.appkeys import METRICS, PLACER, STATE, TELEMETRY
from gateway.config import ConfigError, GatewayConfig, parse_config
from gateway.errors import InvalidRequest
from gateway.fleet import rings
from gateway.fleet.discovery import Discovered, discover
from gateway.fleet.fleet import Fleet
from gateway.reload_fanout import FANOUT, GATEWAY_ID
from gateway.residency.store import StoreUnavailable
from gateway.state import Serving
from gateway.tasks import cancel_and_wait
from gateway.tenants.directory import TenantDirectory

log = logging.getLogger(__name__)

# Bound to the running process: the listener (its address; aiohttp's body limit and shutdown timeout are set when
# the app and its runner are built), the admin token's variable (read at start), the Redis clients (residency,
# buckets, registry, the traffic exchange, the homes table's lease: built once), the traffic meter and the placement
# interval, the tracer provider. Everything else a reload applies: pools, routing, tenants, adapters, splits, the
# other limits, auth, residency intervals, the other placement settings, telemetry.access_log and
# telemetry.engine_scrape_interval_s, shutdown.drain_delay_s (read at SIGTERM).
RESTART_ONLY = (
    "listen", "admin", "state", "limits.max_body_bytes", "telemetry.tracing", "shutdown.drain_timeout_s", "traffic",
    "placement.interval_s",
)  # fmt: skip


@dataclass
class ReloadResult:
    pools: list[str]
    restart_required: list[str] = field(default_factory=list)
    config_digest: str = ""  # sha256 of the config file as read for this reload

    @property
    def warnings(self) -> list[str]:
        return [f"{name} changed but applies only after a restart" for name in self.restart_required]

    def as_json(self) -> dict[str, Any]:
        return {
            "status": "reloaded", "pools": self.pools, "restart_required": self.restart_required,
            "warnings": self.warnings, "config_digest": self.config_digest,
        }  # fmt: skip


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
            data = await asyncio.to_thread(_read, state.config_path)
            base = parse_config(data.decode(), str(state.config_path))
            discovered = await discover(base, state.discovered)
            config = state.compose(base, discovered)  # with DNS's replicas and the run-time tenants and keys
        except Exception as exc:  # ConfigError, or anything else: the old config keeps serving
            problems = getattr(exc, "problems", [str(exc)])
            raise ReloadRefused(
                "The new config was refused; the old one keeps serving: " + "; ".join(problems)
            ) from exc
        await _rebuild(app, config, base, discovered)
        app[TELEMETRY].access_log = config.telemetry.access_log
    # Against what the process runs (its start-up config), so a second reload still says so.
    digest = hashlib.sha256(data).hexdigest()  # as `sha256sum` prints it for the file
    result = ReloadResult(sorted(config.pools_by_name), restart_required(state.started_config, config), digest)
    app[METRICS].restart_pending(result.restart_required)
    for warning in result.warnings:
        log.warning("reload: %s", warning)
    log.info("config reloaded from %s: pools %s", state.config_path, sorted(config.pools_by_name))
    return result


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read: {exc.strerror}"]) from exc


async def reload_answer(app: web.Application) -> dict[str, Any]:
    """This gateway's reload as another gateway's fan-out collects it: never raises."""
    try:
        result = await reload(app)
    except ReloadRefused as exc:
        return {"gateway": GATEWAY_ID, "status": "refused", "error": str(exc)}
    except Exception as exc:
        log.exception("reload failed; the old config keeps serving")
        return {"gateway": GATEWAY_ID, "status": "failed", "error": str(exc)}
    return {"gateway": GATEWAY_ID, **result.as_json()}


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
    # The rings' points (an md5 each) on a worker thread, not the event loop every tenant's requests run on; held
    # here until the fleet's rings hold them.
    placed = await asyncio.to_thread(rings.prepare, config)
    fleet = Fleet(
        config, app[METRICS], store=state.residency_store, homes_from=base, scrapes=state.scrapes,
        signal=state.slot_signal,
    )  # fmt: skip
    del placed
    try:
        await fleet.start()
        await fleet.started_up()
    except BaseException:  # refused or cancelled: the new fleet must not run on beside the serving one
        await fleet.close()
        raise
    # The tenants and keys as the registry holds them now: a change (a revocation) may have come in meanwhile.
    config = state.compose(base, discovered, lenient=True)
    app[DRAINS].apply(fleet)  # the operator's drains hold on the new fleet before it serves
    if config.routing.home_placement == "traffic":  # and the homes table
        app[PLACER].install(fleet)
    old = state.swap(Serving(config, TenantDirectory(config), fleet), base_config=base, discovered=discovered)
    if old is not None:
        old.fleet.stop_background()  # one fleet manages the replicas; the old one only finishes its requests
        task = asyncio.create_task(_retire(old.fleet, config.shutdown.drain_timeout_s), name="retire old fleet")
        _retiring.add(task)
        task.add_done_callback(_retiring.discard)


async def close_retiring() -> None:
    """At shutdown: the fleets still finishing requests after a reload are closed too."""
    await cancel_and_wait(_retiring)


def restart_required(running: GatewayConfig, new: GatewayConfig) -> list[str]:
    """Each setting under ``RESTART_ONLY`` whose value in ``new`` differs from the running one, by its full path."""
    old_data, new_data = running.model_dump(mode="json"), new.model_dump(mode="json")
    changed: list[str] = []
    for path in RESTART_ONLY:
        changed += _differences(path, _at(old_data, path), _at(new_data, path))
    return sorted(changed)


def _at(data: Any, path: str) -> Any:
    for part in path.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _differences(path: str, old: Any, new: Any) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [
            d
            for key in sorted(old.keys() | new.keys())
            for d in _differences(f"{path}.{key}", old.get(key), new.get(key))
        ]
    return [] if old == new else [path]


async def _retire(fleet: Fleet, drain_timeout_s: float) -> None:
    """Close the old fleet once its requests are done (they finish on the replicas they started on)."""
    try:
        if not await fleet.drained(drain_timeout_s):
            log.warning("closing the old fleet with %d requests still in flight", fleet.in_flight)
    finally:
        with contextlib.suppress(Exception):
            await fleet.close(close_store=False)


async def admin_reload(request: web.Request) -> web.Response:
    """This gateway's reload (refused: 400, as it was), then, with Redis and unless ``?scope=local``, every other
    live gateway's: their answers under ``gateways`` (this one's included), who did not answer under ``missing``."""
    # Shielded: an admin client that gives up must not cancel a rebuild (or the collection) half-way.
    result = await asyncio.shield(reload(request.app))
    answer: dict[str, Any] = {"gateway": GATEWAY_ID, **result.as_json()}
    fanout = request.app.get(FANOUT)
    if fanout is not None and request.query.get("scope") != "local":
        try:
            answer |= await asyncio.shield(fanout.everywhere(dict(answer)))
        except StoreUnavailable as exc:
            answer["fanout"] = f"only this gateway reloaded: Redis did not answer ({exc})"
    return web.json_response(answer)
