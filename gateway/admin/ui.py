"""The operator's status page (``/admin/ui``) and the state it shows (``/admin/state``).

The page logs in with the admin token and then holds a session cookie (HttpOnly, SameSite=Strict, path /admin,
Secure when served over TLS or behind a proxy that says so), signed so that every gateway accepts it
(gateway/admin/sessions.py); every action also needs the page's CSRF token in ``X-CSRF-Token``. Every admin
answer is ``Cache-Control: no-store`` and ``X-Content-Type-Options: nosniff`` (gateway/admin/answers.py).
Everything it loads comes from the gateway (a Content-Security-Policy forbids anything else). ``/admin/state`` also
takes the admin token as a Bearer, for `tenantgate status` and scripts. Drain and undrain are also plain admin
endpoints for scripts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.admin.adapter_ops import unload_adapter, warm_adapter
from gateway.admin.answers import AdminRoutes
from gateway.admin.auth import login_allowed, login_failed, require_admin, same_token
from gateway.admin.body import json_object
from gateway.admin.drains import DRAINS
from gateway.admin.sessions import SESSION_S, Session, SessionSigner, session_key
from gateway.admin.siblings import SIBLINGS
from gateway.admin.status import snapshot
from gateway.appkeys import ADMIN_TOKEN, METRICS, STATE
from gateway.errors import AuthenticationFailed, InvalidRequest, ModelNotFound, RequestRateLimited, StoreUnreachable
from gateway.residency.store import StoreUnavailable
from gateway.serving.connections import authenticated
from gateway.serving.json_body import RefusedInput

_UI = Path(__file__).with_name("static")
_COOKIE = "tenantgate_session"
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
_ASSETS = {"app.js": "application/javascript", "app.css": "text/css"}


SIGNER = web.AppKey("ui_session_signer", SessionSigner)


def _session(request: web.Request) -> Session | None:
    session = request.app[SIGNER].read(request.cookies.get(_COOKIE, ""))
    if session is None:
        return None
    authenticated(request)  # its connection is no longer one of the unauthenticated the listener caps
    return session


def _page(name: str, **values: str) -> web.Response:
    text = (_UI / name).read_text()
    for key, value in values.items():
        text = text.replace("{" + key + "}", value)
    return web.Response(text=text, content_type="text/html", headers={"Content-Security-Policy": _CSP})


async def ui(request: web.Request) -> web.Response:
    """The page, or only the login form without a session."""
    session = _session(request)
    if session is None:
        return _page("login.html", error="")
    return _page("page.html", csrf=session.csrf)


async def login(request: web.Request) -> web.Response:
    token = request.app[ADMIN_TOKEN]
    try:
        address = login_allowed(request)
    except RequestRateLimited as exc:
        page = _page("login.html", error="Too many failed logins from this address; try again later.")
        page.set_status(exc.status)
        page.headers.update(exc.headers)
        return page
    form = await request.post()
    presented = str(form.get("token", ""))
    if not token or not same_token(presented, token):
        if token:
            login_failed(request, address)
        page = _page("login.html", error="Wrong token." if token else "The admin API is disabled: no token is set.")
        page.set_status(401)
        return page
    cookie, _ = request.app[SIGNER].issue()
    response = web.HTTPSeeOther("/admin/ui")
    response.set_cookie(
        _COOKIE, cookie, httponly=True, samesite="Strict", path="/admin", max_age=SESSION_S,
        secure=_over_tls(request),
    )  # fmt: skip
    raise response


async def logout(request: web.Request) -> web.Response:
    session = _session(request)
    form = await request.post()
    if session is not None and same_token(str(form.get("csrf", "")), session.csrf):
        request.app[SIGNER].log_out(session)
    response = web.HTTPSeeOther("/admin/ui")
    response.del_cookie(_COOKIE, path="/admin")
    raise response


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in _ASSETS:
        raise web.HTTPNotFound()
    return web.Response(text=(_UI / name).read_text(), content_type=_ASSETS[name])


def _over_tls(request: web.Request) -> bool:
    """Served over TLS, here or at a proxy in front that says so (X-Forwarded-Proto). Believing any sender is
    safe: a Secure cookie on a plain-HTTP page only fails that client's own login."""
    forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    return request.secure or forwarded == "https"


def _require_session_or_token(request: web.Request) -> None:
    if _session(request) is None:
        require_admin(request)


async def state(request: web.Request) -> web.Response:
    _require_session_or_token(request)
    siblings = request.app.get(SIBLINGS)
    if siblings is not None:  # serve --workers: every worker's figures (gateway/admin/siblings.py)
        return web.json_response(await siblings.merged("state"))
    gateway = request.app[STATE]
    return web.json_response(snapshot(gateway.serving, request.app[METRICS], gateway.serving.fleet.store_up))


def _replica(request: web.Request, body: dict[str, Any]) -> tuple[Any, str]:
    pools = request.app[STATE].serving.fleet.pools
    pool, replica = pools.get(str(body.get("pool"))), str(body.get("replica"))
    if pool is None or replica not in pool.replicas:
        raise InvalidRequest("No such pool and replica.", param="replica")
    return pool, replica


async def _act(request: web.Request, action: str, body: dict[str, Any]) -> dict[str, Any]:
    if action in ("drain", "undrain"):
        pool, replica = _replica(request, body)
        drains = request.app[DRAINS]
        try:  # kept beside the fleet (a reload keeps it) and, with Redis, where every gateway reads it
            await drains.set(pool.name, replica, action == "drain")
        except StoreUnavailable as exc:
            raise StoreUnreachable(f"Not {action}ed: the shared store is unreachable ({exc}).") from exc
        drains.apply(request.app[STATE].serving.fleet)
        return {"pool": pool.name, "replica": replica, "drained": action == "drain"}
    serving = request.app[STATE].serving
    adapter = next((a for a in serving.config.adapters if a.name == body.get("adapter")), None)
    if adapter is None:
        raise ModelNotFound("No such adapter in the catalog.", param="adapter")
    if action == "warm":
        return {"adapter": adapter.name, "warmed_on": await warm_adapter(serving, adapter)}
    if action == "unload":
        return {"adapter": adapter.name, "unloaded_from": await unload_adapter(serving, adapter)}
    raise InvalidRequest(f"Unknown action {action!r}.")


async def action(request: web.Request) -> web.Response:
    """A page action: needs the session and its CSRF token."""
    session = _session(request)
    if session is None:
        raise AuthenticationFailed("Log in first.")
    presented = request.headers.get("X-CSRF-Token", "")
    if not presented.isascii():  # the page's tokens are URL-safe base64: anything else is a malformed request
        raise RefusedInput("The X-CSRF-Token header must be ASCII.", "shape", param="X-CSRF-Token")
    if not same_token(presented, session.csrf):
        raise AuthenticationFailed("The CSRF token is missing or wrong.")
    body = await json_object(request, empty_is={})
    return web.json_response({"status": "ok", **await _act(request, request.match_info["action"], body)})


async def drain(request: web.Request) -> web.Response:
    """Scripts: POST /admin/replicas/{pool}/{replica}/drain or /undrain with the admin token."""
    require_admin(request)
    body = {"pool": request.match_info["pool"], "replica": request.match_info["replica"]}
    return web.json_response({"status": "ok", **await _act(request, request.match_info["action"], body)})


def add_routes(app: web.Application) -> None:
    admin = AdminRoutes(app)
    # ConfigError: a weak TENANTGATE_SESSION_KEY is refused. Without any key no session exists (admin API off).
    app[SIGNER] = SessionSigner(session_key(app[ADMIN_TOKEN], os.environ))
    admin.get("/admin/ui", ui)
    admin.post("/admin/ui/login", login)
    admin.post("/admin/ui/logout", logout)
    admin.get("/admin/ui/{name}", asset)
    admin.post("/admin/ui/actions/{action}", action)
    admin.get("/admin/state", state)
    admin.post(r"/admin/replicas/{pool}/{replica}/{action:drain|undrain}", drain)
