"""Under ``serve --workers``: the admin API and the status page answer for every worker, not the one that accepted.

Each worker serves its own figures (``/admin/state``'s and ``/admin/residency``'s documents, with its TTFT samples
rather than percentiles) on a Unix socket in the supervisor's private directory (mode 0700: only the gateway's own
user reaches it), and the worker that answers an admin request asks the others there, at once, and merges
(gateway/admin/merge.py). Why the answering worker and not the supervisor: the supervisor holds no fleet and no
event loop (it only keeps the workers running), while the answering worker has its own share already; and asking
on demand costs nothing between admin requests, where publishing every worker's figures would cost every
interval. A worker that does not answer within ``_ASK_TIMEOUT_S`` (being replaced, say) is named in the answer's
``missing_workers``; the rest is still merged.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any, Literal

import aiohttp
from aiohttp import web

from gateway.admin.merge import merge_residency, merge_state
from gateway.admin.status import residency_json, snapshot
from gateway.appkeys import METRICS, STATE
from gateway.observe import shared_metrics
from gateway.workers import WorkerSockets

Document = Literal["state", "residency"]
_SOCKET = "admin"
_ASK_TIMEOUT_S = 2.0


class Siblings:
    def __init__(self, app: web.Application, sockets: WorkerSockets) -> None:
        self._app = app
        self.sockets = sockets
        self._runner: web.AppRunner | None = None
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def own(self, what: Document) -> dict[str, Any]:
        """This worker's own document, with who it is and how many requests it has in flight."""
        state = self._app[STATE]
        fleet = state.serving.fleet
        if what == "state":
            document = snapshot(state.serving, self._app[METRICS], fleet.store_up, samples=True)
        else:
            document = residency_json(fleet)
        scrapes = state.scrapes
        document["worker"] = {
            "worker": self.sockets.worker,
            "pid": os.getpid(),
            "in_flight": fleet.in_flight,
            "scrapes_engines": scrapes is not None and scrapes.leading,
        }
        return document

    async def merged(self, what: Document) -> dict[str, Any]:
        """This worker's document merged with every sibling's that answers."""
        own = self.own(what)
        siblings = self.sockets.siblings()
        answers = await asyncio.gather(*(self._ask(sibling, what) for sibling in siblings))
        others = [answer for answer in answers if answer is not None]
        missing = [sibling for sibling, answer in zip(siblings, answers, strict=True) if answer is None]
        merge = merge_state if what == "state" else merge_residency
        return merge(own, others, missing)

    async def flush_metrics(self) -> None:
        """Every sibling that answers has written its metric values to the shared files (a scrape then sums every
        living worker's counts up to now: gateway/observe/shared_metrics.py)."""
        await asyncio.gather(*(self._flush(sibling) for sibling in self.sockets.siblings()))

    async def _flush(self, sibling: int) -> None:
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):  # not answering: its last timed flush counts
            timeout = aiohttp.ClientTimeout(total=_ASK_TIMEOUT_S)
            async with self._session(sibling).post("http://worker/own/flush", timeout=timeout) as response:
                await response.read()

    def _session(self, sibling: int) -> aiohttp.ClientSession:
        session = self._sessions.get(sibling)
        if session is None:
            connector = aiohttp.UnixConnector(str(self.sockets.socket_path(_SOCKET, sibling)))
            session = self._sessions[sibling] = aiohttp.ClientSession(connector=connector)
        return session

    async def _ask(self, sibling: int, what: Document) -> dict[str, Any] | None:
        session = self._session(sibling)
        try:
            timeout = aiohttp.ClientTimeout(total=_ASK_TIMEOUT_S)
            async with session.get(f"http://worker/own/{what}", timeout=timeout) as response:
                if response.status != 200:
                    return None
                document: dict[str, Any] = await response.json()
                return document
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None

    async def _answer(self, request: web.Request) -> web.Response:
        what = request.match_info["what"]
        if what not in ("state", "residency"):
            raise web.HTTPNotFound()
        return web.json_response(self.own("state" if what == "state" else "residency"))

    async def _answer_flush(self, request: web.Request) -> web.Response:
        shared_metrics.flush()
        return web.Response(status=204)

    async def running(self, app: web.Application) -> AsyncIterator[None]:
        """A cleanup context: answer the siblings while the app runs."""
        internal = web.Application()
        internal.router.add_get("/own/{what}", self._answer)
        internal.router.add_post("/own/flush", self._answer_flush)
        self._runner = web.AppRunner(internal, access_log=None)
        await self._runner.setup()
        path = self.sockets.socket_path(_SOCKET)
        path.unlink(missing_ok=True)  # a previous worker with this number left it
        await web.UnixSite(self._runner, str(path)).start()
        yield
        for session in self._sessions.values():
            with contextlib.suppress(Exception):
                await session.close()
        await self._runner.cleanup()
        path.unlink(missing_ok=True)


SIBLINGS = web.AppKey("siblings", Siblings)
