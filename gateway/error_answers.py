"""How an error leaves: an OpenAI error body with its status, whatever a handler raised; nothing a client sends
can take the gateway down. ``error_answer`` answers for every route; an admin route answers its own errors the
same way (gateway/admin/answers.py), to mark them as admin answers. The app's one middleware (gateway/app.py's
``front``) answers with ``error_answer`` whatever a handler raised."""

from __future__ import annotations

import logging

from aiohttp import web

from gateway.appkeys import METRICS, STATE, TELEMETRY
from gateway.errors import GatewayError, MethodNotAllowed, PayloadTooLarge, RouteNotFound
from gateway.serving.json_body import RefusedInput, undecodable

# The logger these lines were always written under (they were the app factory's), so log filters keep working.
log = logging.getLogger("gateway.app")


def error_answer(request: web.Request, exc: Exception) -> web.StreamResponse:
    """The answer to what a handler raised. aiohttp's own HTTP exceptions other than the ones mapped here (a
    redirect) are raised again, for aiohttp to answer with. Called while ``exc`` is being handled (an unexpected
    one is logged with its traceback)."""
    if isinstance(exc, RefusedInput):
        return _refused(request, exc)
    if isinstance(exc, GatewayError):
        return exc.response()
    if isinstance(exc, web.RequestPayloadError):  # a body read where read_body was not used (a form): the same
        return _refused(request, undecodable(request, exc))
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        limit = request.app[STATE].config.limits.max_body_bytes
        return PayloadTooLarge(f"The request body is larger than the limit of {limit} bytes.").response()
    if isinstance(exc, web.HTTPNotFound):
        return RouteNotFound(f"No route {request.method} {request.path}.").response()
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return MethodNotAllowed(f"{request.method} is not allowed on {request.path}.").response()
    if isinstance(exc, web.HTTPException):
        raise exc
    log.exception("unhandled error on %s %s", request.method, request.path)
    return GatewayError("The gateway failed to handle the request.").response()


def _refused(request: web.Request, exc: RefusedInput) -> web.Response:
    """One line and one count per refused body, never a traceback, whatever the body was: the request's access
    line on a tenant endpoint (its error says refused:<reason>), else a line here. A body that did not decode
    leaves its connection's parser mid-body: the connection closes after the answer."""
    surface = "admin" if request.path.startswith("/admin") else "tenant"
    request.app[METRICS].refused_inputs.labels(surface, exc.reason).inc()
    if not (surface == "tenant" and request.app[TELEMETRY].access_log):  # else its access line says it
        log.info("refused %s %s (%s): %s", request.method, request.path, exc.reason, exc.message[:200])
    response = exc.response()
    if exc.reason == "encoding":
        response.force_close()
    return response
