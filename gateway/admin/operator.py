"""The operator surfaces (``/metrics``, the admin API, the status page) and where they answer.

``/metrics`` names every tenant and adapter, so a public one would undo the indistinguishable 404 of another
tenant's model. Two ways to keep it from tenants (README, "Security defaults"):

- ``admin.listen`` unset (the default): one listener. ``/metrics`` needs a Bearer token, the read-only metrics token
  (``admin.metrics_token_env``) or the admin token; with neither set it is the 404 of a disabled admin API. A wrong
  token counts as a failed admin login (the same per-address limit).
- ``admin.listen: {host, port}``: a second listener, served by the same app and runner. Operator paths answer only
  there and tenant paths only on the tenant listener; on the wrong one either is the 404 of any unknown route
  (probes answer on both). ``/metrics`` there needs no token (a Prometheus scrape job that follows pod annotations
  sends none): who can connect is the listener's address and the network's policy. ``/admin`` still needs the
  admin token.

Which listener a request came in on is its connection's handler class: ``OperatorSite`` builds ``OperatorHandler``s
(a ``HandlerSite``, as ``GuardedSite`` is: the same private ``Server._kwargs`` reading, pinned to aiohttp 3.14).
The operator listener is not under the tenant listener's connection guard: it is not for tenants to reach.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from gateway.admin.auth import require_bearer
from gateway.admin.siblings import SIBLINGS
from gateway.appkeys import ADMIN_TOKEN, METRICS
from gateway.errors import AdminDisabled, RouteNotFound
from gateway.serving.connections import HandlerSite

# The read-only metrics token ("" when none is set) and whether operator paths have a listener of their own.
METRICS_TOKEN = web.AppKey("metrics_token", str)
SEPARATE_LISTENER = web.AppKey("separate_operator_listener", bool)

PROBES = frozenset({"/healthz", "/readyz"})


def operator_path(path: str) -> bool:
    return path == "/metrics" or path == "/admin" or path.startswith("/admin/")


class OperatorHandler(RequestHandler):
    """aiohttp's request handler for a connection to the operator listener (its class is the mark)."""


def on_operator_listener(request: web.BaseRequest) -> bool:
    return isinstance(request.protocol, OperatorHandler)


class OperatorSite(HandlerSite):
    """A TCP site whose connections are ``OperatorHandler``s: a second site on the gateway's runner."""

    def connection(self, server: web.Server) -> OperatorHandler:
        return OperatorHandler(server, loop=asyncio.get_running_loop(), **server._kwargs)


def check_surface(request: web.Request) -> None:
    """With an operator listener, each path answers on its own listener only (probes on both): RouteNotFound
    elsewhere, answered as any unknown route (gateway/app.py's ``front`` middleware calls it)."""
    separate = request.app[SEPARATE_LISTENER] and request.path not in PROBES
    if separate and operator_path(request.path) != on_operator_listener(request):
        raise RouteNotFound(f"No route {request.method} {request.path}.")


def require_metrics_reader(request: web.Request) -> None:
    """On the operator listener anyone who can connect may read; elsewhere the metrics or the admin token."""
    if on_operator_listener(request):
        return
    tokens = [token for token in (request.app[METRICS_TOKEN], request.app[ADMIN_TOKEN]) if token]
    if not tokens:
        raise AdminDisabled("Metrics are not served here: no metrics or admin token is configured.")
    require_bearer(request, tokens, "A valid metrics or admin token is required.")


async def metrics(request: web.Request) -> web.Response:
    require_metrics_reader(request)
    siblings = request.app.get(SIBLINGS)
    if siblings is not None:  # serve --workers: every worker's counts up to now (gateway/observe/shared_metrics.py)
        await siblings.flush_metrics()
    return web.Response(
        body=request.app[METRICS].exposition(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


def add_routes(app: web.Application) -> None:
    app.router.add_get("/metrics", metrics)
