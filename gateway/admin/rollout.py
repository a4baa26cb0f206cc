"""Rolling out a new version of an adapter without downtime.

An adapter's tenant-facing name is a split (``splits`` in config) whose one variant is the serving version, e.g.
``support-acme`` -> ``support-acme@1``. ``POST /admin/adapters/{name}/rollout {version, steps, step_s}``:

1. pre-warms the new version on the replicas where the name's tenants live;
2. shifts traffic in steps (by default 10%, 50%, 100%) by changing the split's weights through the registry,
   so every gateway sharing Redis follows; each end user stays on one version within a step (the split is sticky);
3. after each step's pause compares the versions' outcomes in that step: if the new one's error rate exceeds the
   old one's by more than ``max_error_rate_increase``, or its TTFT p99 by more than ``max_ttft_p99_ratio`` times,
   it halts and rolls back at once;
4. at 100%, waits until nothing uses the old version, then unloads it everywhere.

``POST .../rollback`` returns the name to the old version at once. The controller runs in the gateway that
received the request; if that gateway stops mid-way the split stays where it was (safe), and a new rollout or
rollback takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backends.base import AdapterRef
from backends.errors import BackendError
from gateway.admin.answers import AdminRoutes
from gateway.admin.auth import require_admin
from gateway.admin.body import json_object
from gateway.appkeys import METRICS, STATE
from gateway.config import ConfigError, SplitConfig
from gateway.errors import GatewayError, InvalidRequest, ModelNotFound
from gateway.fleet.fleet import prewarm_homes
from gateway.observe.activity import Activity
from gateway.state import GatewayState
from gateway.tasks import cancel_and_wait

log = logging.getLogger(__name__)

MIN_SAMPLES = 5


@dataclass
class Rollout:
    name: str
    old: str
    new: str
    steps: list[float]
    step_s: float
    max_error_rate_increase: float
    max_ttft_p99_ratio: float
    status: str = "starting"  # starting, running, done, rolled_back, failed
    reason: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


ROLLOUTS = web.AppKey("rollouts", dict)  # name -> (Rollout, its task)


def _split(name: str, old: str, new: str, share: float) -> dict[str, Any]:
    if share <= 0:
        variants = [{"model": old, "weight": 1}]
    elif share >= 1:
        variants = [{"model": new, "weight": 1}]
    else:
        variants = [{"model": old, "weight": 1 - share}, {"model": new, "weight": share}]
    return SplitConfig.model_validate({"name": name, "variants": variants}).model_dump()


async def _set_share(state: GatewayState, rollout: Rollout, share: float) -> None:
    change = {"kind": "set_split", "split": _split(rollout.name, rollout.old, rollout.new, share)}
    await state.registry.change(change, state.base_config)
    state.refresh_tenants()


def judge(activity: Activity, rollout: Rollout, since: float) -> str | None:
    """Why the new version should not go on (None: it may): error rate and TTFT p99 against the old one's."""
    old, new = activity.outcomes(rollout.old, since), activity.outcomes(rollout.new, since)
    if len(new) < MIN_SAMPLES:
        return None

    def error_rate(outcomes: list[tuple[float, bool, float | None]]) -> float:
        return sum(not ok for _, ok, _ in outcomes) / len(outcomes) if outcomes else 0.0

    def p99(outcomes: list[tuple[float, bool, float | None]]) -> float | None:
        ttfts = sorted(t for _, ok, t in outcomes if ok and t is not None)
        return ttfts[int(0.99 * (len(ttfts) - 1))] if len(ttfts) >= MIN_SAMPLES else None

    errors_new, errors_old = error_rate(new), error_rate(old)
    if errors_new > errors_old + rollout.max_error_rate_increase:
        return f"error rate {errors_new:.0%} against {errors_old:.0%} for {rollout.old}"
    p99_new, p99_old = p99(new), p99(old)
    if p99_new is not None and p99_old is not None and p99_new > p99_old * rollout.max_ttft_p99_ratio:
        return f"TTFT p99 {p99_new:.0f} ms against {p99_old:.0f} ms for {rollout.old}"
    return None


async def _run(app: web.Application, rollout: Rollout) -> None:
    state = app[STATE]
    try:
        serving = state.serving
        adapter = next(a for a in serving.config.adapters if a.name == rollout.new)
        pool = serving.fleet.pools[adapter.pool]
        homes = sorted(prewarm_homes(serving.config, pool, rollout.new, split=rollout.name))
        ref = AdapterRef(adapter.engine_name or adapter.name, adapter.source)
        try:
            for replica_id in homes:
                await pool.residency.warm(replica_id, ref, pinned=False, bounded=False)
        except (BackendError, GatewayError) as exc:  # it fails before any user sees it: never shifted
            rollout.status, rollout.reason = "rolled_back", f"the new version failed its warm-up: {exc}"
            log.warning("rollout of %s to %s %s", rollout.name, rollout.new, rollout.reason)
            return
        rollout.status = "running"
        for share in rollout.steps:
            await _set_share(state, rollout, share)
            started = time.time()
            rollout.history.append({"share": share, "started": round(started, 3)})
            if share >= 1:
                break
            await asyncio.sleep(rollout.step_s)
            reason = judge(app[METRICS].activity, rollout, started)
            if reason is not None:
                await _set_share(state, rollout, 0.0)
                rollout.status, rollout.reason = "rolled_back", f"halted at {share:.0%}: {reason}"
                log.warning("rollout of %s to %s %s", rollout.name, rollout.new, rollout.reason)
                return
        rollout.status = "done"
        await _unload_when_idle(app, rollout)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        rollout.status, rollout.reason = "failed", str(exc)
        log.exception("rollout of %s to %s failed", rollout.name, rollout.new)
        with contextlib.suppress(Exception):
            await _set_share(state, rollout, 0.0)


async def _unload_when_idle(app: web.Application, rollout: Rollout) -> None:
    """The old version leaves the replicas once no request uses it any more."""
    serving = app[STATE].serving
    adapter = next((a for a in serving.config.adapters if a.name == rollout.old), None)
    if adapter is None:
        return
    pool = serving.fleet.pools[adapter.pool]
    engine_name = adapter.engine_name or adapter.name
    for _ in range(600):  # bounded: at most a minute of waiting for its last requests
        if not any(engine_name in view.in_flight for view in pool.residency.views.values()):
            break
        await asyncio.sleep(0.1)
    await pool.residency.unload_everywhere(engine_name)
    rollout.history.append({"unloaded": rollout.old, "at": round(time.time(), 3)})


class RolloutRequest(BaseModel):
    """The body of ``POST .../rollout``: checked whole, so a wrong shape is a 400 naming the field."""

    model_config = ConfigDict(frozen=True)

    version: Annotated[str, Field(min_length=1, max_length=128)] | Annotated[int, Field(ge=0)]
    steps: list[Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]] = Field(
        default=[0.1, 0.5, 1.0], min_length=1, max_length=100
    )
    step_s: float = Field(default=30.0, gt=0, le=86_400, allow_inf_nan=False)
    max_error_rate_increase: float = Field(default=0.05, ge=0, le=1, allow_inf_nan=False)
    max_ttft_p99_ratio: float = Field(default=1.5, gt=0, le=1000, allow_inf_nan=False)


def _rollout_request(body: dict[str, Any]) -> RolloutRequest:
    try:
        return RolloutRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        field_name = str(first["loc"][0]) if first["loc"] else None
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise InvalidRequest(
            f"Bad rollout request: {where}: {first['msg']} (send {{version, steps, step_s}}).", param=field_name
        ) from exc


async def start(request: web.Request) -> web.Response:
    require_admin(request)
    name = request.match_info["name"]
    asked = _rollout_request(await json_object(request))
    serving = request.app[STATE].serving
    split = next((s for s in serving.config.splits if s.name == name), None)
    if split is None or len(split.variants) != 1:
        raise InvalidRequest(f"{name!r} is not a versioned name served by one version (a split with one variant).")
    version = str(asked.version)
    new = version if "@" in version else f"{name}@{version}"
    catalog = {a.name: a for a in serving.config.adapters}
    old = split.variants[0].model
    if new not in catalog:
        raise ModelNotFound(f"No adapter {new!r} in the catalog: add it first.", param="version")
    if old in catalog and catalog[old].pool != catalog[new].pool:
        raise InvalidRequest("The new version must live in the same pool as the old one.", param="version")
    steps = asked.steps
    rollouts = request.app[ROLLOUTS]
    running = rollouts.get(name)
    if running is not None and not running[1].done():
        raise InvalidRequest(f"A rollout of {name!r} is already running; roll it back first.")
    rollout = Rollout(
        name, old, new, list(steps) if steps[-1] == 1 else [*steps, 1.0],
        asked.step_s, asked.max_error_rate_increase, asked.max_ttft_p99_ratio,
    )  # fmt: skip
    task = asyncio.create_task(_run(request.app, rollout), name=f"rollout {name}")
    rollouts[name] = (rollout, task)
    return web.json_response(rollout.as_json(), status=202)


async def show(request: web.Request) -> web.Response:
    require_admin(request)
    running = request.app[ROLLOUTS].get(request.match_info["name"])
    if running is None:
        raise ModelNotFound("No rollout of that name.", param="name")
    return web.json_response(running[0].as_json())


async def rollback(request: web.Request) -> web.Response:
    require_admin(request)
    name = request.match_info["name"]
    running = request.app[ROLLOUTS].get(name)
    if running is None:
        raise ModelNotFound("No rollout of that name.", param="name")
    rollout, task = running
    await cancel_and_wait([task])
    try:
        await _set_share(request.app[STATE], rollout, 0.0)
    except ConfigError as exc:
        raise InvalidRequest("Rollback refused: " + "; ".join(exc.problems)) from exc
    rollout.status, rollout.reason = "rolled_back", "rolled back by an operator"
    return web.json_response(rollout.as_json())


async def _cancel_all(app: web.Application) -> None:
    await cancel_and_wait(task for _, task in app[ROLLOUTS].values())


def add_routes(app: web.Application) -> None:
    admin = AdminRoutes(app)
    app[ROLLOUTS] = {}
    app.on_cleanup.append(_cancel_all)
    admin.post("/admin/adapters/{name}/rollout", start)
    admin.get("/admin/adapters/{name}/rollout", show)
    admin.post("/admin/adapters/{name}/rollback", rollback)
