"""Admin answers, errors included, are never cached (tokens, tenants, the CSRF token) and never sniffed.

The headers are set by a wrapper on each admin route's handler (``AdminRoutes`` adds them so), not by a hook on
every response: a tenant's request runs no admin code. The wrapper answers its handler's errors as
the app's middleware would (``error_answer``), so that they carry the headers too. A path under /admin that is no
route (the 404 of an unknown route) is not an admin answer: it names nothing but the path.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.error_answers import error_answer

ADMIN_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def admin_answers(handler: Handler) -> Handler:
    """``handler``, whose every answer carries ``ADMIN_HEADERS``."""

    @functools.wraps(handler)
    async def answer(request: web.Request) -> web.StreamResponse:
        try:
            try:
                response = await handler(request)
            except Exception as exc:
                response = error_answer(request, exc)
        except web.HTTPException as passed_on:  # a redirect (the status page's login and logout): aiohttp answers
            passed_on.headers.update(ADMIN_HEADERS)
            raise
        response.headers.update(ADMIN_HEADERS)
        return response

    return answer


class AdminRoutes:
    """The app's router for admin routes: each handler is added through ``admin_answers``."""

    def __init__(self, app: web.Application) -> None:
        self._router = app.router

    def get(self, path: str, handler: Handler) -> None:
        self._router.add_get(path, admin_answers(handler))

    def post(self, path: str, handler: Handler) -> None:
        self._router.add_post(path, admin_answers(handler))

    def put(self, path: str, handler: Handler) -> None:
        self._router.add_put(path, admin_answers(handler))

    def delete(self, path: str, handler: Handler) -> None:
        self._router.add_delete(path, admin_answers(handler))
