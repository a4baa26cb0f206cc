"""Run the gateway in the foreground: SIGHUP reloads the config, SIGTERM (or SIGINT) drains and exits 0."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from pathlib import Path

import uvloop
from aiohttp import web

from gateway.admin.operator import OperatorSite
from gateway.app import GatewayRunner, create_app
from gateway.appkeys import METRICS, STATE
from gateway.config import GatewayConfig
from gateway.fleet import heap, warm_up
from gateway.observe import logs
from gateway.reload import ReloadRefused, reload
from gateway.serving.connections import ConnectionGuard, HandlerSite, keepalive_timeout
from gateway.serving.own_server import OwnSite
from gateway.workers import WorkerSockets

log = logging.getLogger("tenantgate")

GC_YOUNG_THRESHOLD = 10_000


async def _run(config: GatewayConfig, config_path: Path | None, worker: WorkerSockets | None) -> None:
    app = create_app(config, config_path, worker=worker)
    # handler_cancellation: a client that goes away cancels its handler, which cancels the upstream request.
    # shutdown_timeout: on shutdown, in-flight handlers get this long to finish before they are cancelled.
    # keepalive_timeout: aiohttp's own idle timer (an hour by default), as a backstop behind the guard's, which
    # adds the other client deadlines and the connection caps (gateway/serving/connections.py).
    # GatewayRunner: aiohttp's, with the inference endpoints served without the router (gateway/app.py).
    runner = GatewayRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=config.shutdown.drain_timeout_s,
        keepalive_timeout=keepalive_timeout(config.listen),
    )  # fmt: skip
    await runner.setup()
    # The small-object heap touched now and left free, so the keys' state a young gateway grows at first sights does
    # not take page faults on the request path (gateway/fleet/heap.py). Before the listener opens: it holds the event
    # loop some 14 ms, which no client should wait for.
    heap.reserve()
    # Each policy's decision code run on a throw-away pool, so the first tenants' requests are not the ones the
    # interpreter specialises it on (gateway/fleet/warm_up.py). Before the listener opens, as above.
    serving = app[STATE].serving
    warm_up.decisions(serving.fleet.pools.values(), serving.config.routing)
    guard = ConnectionGuard(config.listen, app[METRICS])
    sites = await listen(runner, config, guard, worker)
    guard.start()
    # What start-up built (modules, config, fleet, metrics) lives as long as the process: out of the cyclic GC's
    # sight, each collection walks only what requests allocate (time in the collector per request, timed with
    # gc.callbacks under bench-gateway's vLLM load: 16 us -> 5 us).
    gc.collect()
    gc.freeze()
    # A young-generation collection every GC_YOUNG_THRESHOLD allocations, not 700: a request allocates a few
    # hundred containers, nearly all freed by reference counting before any collection, so at 700 the collector
    # ran every few requests for little (make bench-overhead, default config: 247 -> 223 us per request).
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    for site in reversed(sites):  # the tenant listener's line last: the gateway is serving
        log.info(
            "tenantgate %s on %s", "operator listener" if isinstance(site, OperatorSite) else "listening", site.name
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[None]] = set()
    loop.add_signal_handler(signal.SIGHUP, lambda: _start_reload(app, reloads))
    await stop.wait()
    app[STATE].draining = True
    log.info("shutting down: not ready any more, draining in-flight requests")
    await asyncio.sleep(app[STATE].config.shutdown.drain_delay_s)  # a reload may have changed it
    await runner.cleanup()
    await guard.stop()
    log.info("shut down")


async def listen(
    runner: web.AppRunner, config: GatewayConfig, guard: ConnectionGuard, worker: WorkerSockets | None
) -> list[HandlerSite]:
    """The tenant listener, and with ``admin.listen`` the operator one, started: their sites, whose ``name`` says
    the port each is bound to (the real one where the config says 0)."""
    # A worker of serve --workers accepts on the sockets its supervisor opened (gateway/workers.py).
    listen_sock = worker.listening() if worker is not None else None
    # The inference routes on the gateway's own server, everything else handed to aiohttp's (serving/own_server.py);
    # its connections drain beside aiohttp's, within the one shutdown timeout (GatewayRunner.drains).
    drains = runner.drains if isinstance(runner, GatewayRunner) else None
    tenant = OwnSite(
        runner, guard, config.listen.host, config.listen.port, sock=listen_sock,
        drain_timeout_s=config.shutdown.drain_timeout_s, drains=drains,
    )  # fmt: skip
    sites: list[HandlerSite] = [tenant]
    operator = config.admin.listen
    if operator is not None:  # /metrics and /admin answer there only (gateway/admin/operator.py)
        operator_sock = worker.operator_listening() if worker is not None else None
        sites.append(OperatorSite(runner, operator.host, operator.port, sock=operator_sock))
    for site in sites:
        await site.start()
    return sites


def _start_reload(app: web.Application, running: set[asyncio.Task[None]]) -> None:
    async def reload_and_log() -> None:
        try:
            await reload(app)
        except ReloadRefused as exc:
            log.error("reload refused: %s", exc)
        except Exception:
            log.exception("reload failed; the old config keeps serving")

    task = asyncio.create_task(reload_and_log(), name="reload")
    running.add(task)
    task.add_done_callback(running.discard)


def serve(config: GatewayConfig, config_path: Path | None = None, worker: WorkerSockets | None = None) -> int:
    # Every line one JSON object (gateway/observe/logs.py); a worker's lines say which worker wrote them.
    logs.configure(worker=worker.worker if worker is not None else None)
    # uvloop's event loop costs the gateway less CPU per request than asyncio's own (make bench-gateway).
    try:
        uvloop.run(_run(config, config_path, worker))
    finally:
        logs.shutdown()  # every queued line written before the process exits (SIGTERM included)
    return 0
