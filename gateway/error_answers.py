"""How an error leaves: an OpenAI error body with its status, whatever a handler raised; nothing a client sends
can take the gateway down. ``error_answer`` answers for every route; an admin route answers its own errors the
same way (gateway/admin/answers.py), to mark them as admin answers. The app's one middleware (gateway/app.py's
``front``) answers with ``error_answer`` whatever a handler raised."""

from __future__ import annotations

import logging

from aiohttp import hdrs, web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from gateway.appkeys import METRICS, STATE, TELEMETRY
from gateway.errors import (
    GatewayError,
    HeaderFieldsTooLarge,
    InvalidRequest,
    MethodNotAllowed,
    PayloadTooLarge,
    RouteNotFound,
)
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


def unread_body(request: web.Request, response: web.StreamResponse) -> None:
    """A request answered before its body was read to the end. aiohttp would read the rest after the answer (its
    lingering close, up to 10 s) and so decode it: a compressed one is decompressed whole on the event loop, for a
    body nobody reads. A 200 KB gzip of 200 MiB (refused 413, or 401 without any key) cost the gateway 0.5-0.7 s of
    CPU each, and another tenant's request 1.7-2.6 s meanwhile. Such a body is not read: its connection closes
    after the answer (the parser is mid-body, so it cannot carry another request). An uncompressed one costs only
    its bytes, which the connection's own bounds limit (serving/connections.py): aiohttp reads it as before."""
    if request.headers.get(hdrs.CONTENT_ENCODING):
        request.content.feed_eof()
        response.force_close()


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


def unparsable_answer(exc: BaseException | None) -> web.Response | None:
    """The answer to a request aiohttp's parser refused (the tenant listener's ``GuardedHandler.handle_error``): an
    OpenAI error body, 431 for a request line or header field over aiohttp's 8,190 bytes or too many headers, else
    400, where aiohttp answers its own plain text. None for what is not a parser's refusal."""
    error: GatewayError
    if isinstance(exc, LineTooLong):
        error = HeaderFieldsTooLarge(f"The request line or a header field is longer than {exc.args[1]} bytes.")
    elif isinstance(exc, BadHttpMessage) and exc.message == "Too many headers received":
        error = HeaderFieldsTooLarge("The request has too many header fields.")
    elif isinstance(exc, BadHttpMessage):
        error = InvalidRequest(f"The request is not valid HTTP/1.1: {exc.message[:200]}")
    else:
        return None
    response = error.response()
    response.force_close()  # the parser cannot go on past what it refused
    return response
