"""A reload reaches every gateway, not only the one a request reached.

Behind a Kubernetes Service, ``POST /admin/reload`` lands on one pod. With Redis (``state.redis_url``) the gateway
asked reloads itself, then publishes the request on ``{prefix}:reload`` and collects, on a reply channel of its
own, each other gateway's answer: its id, whether it reloaded, the digest (sha256) of the config file it now runs
and what needs a restart. Every gateway follows the channel and reloads its own copy of the file (a ConfigMap is
mounted in every pod), exactly as a local reload would. Who to wait for: each gateway keeps itself in
``{prefix}:gateways`` (a sorted set, scored by its last heartbeat on Redis' clock), so the one asked knows which
gateways are alive, waits for those, and names the ones that did not answer in time. Heartbeats and the alive
window are both read on Redis' clock (``TIME`` in a script), never a gateway's own: scored by each gateway's clock,
one running a minute behind was never waited for (its reload silently skipped), and one running minutes ahead
pruned every other gateway from the set at each heartbeat (tests/gateway/test_reload_fanout.py).

A message carries no config, only who asks and where to answer: whoever can publish on Redis can make gateways
re-read their own files, nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

from aiohttp import web
from prometheus_client import Counter
from redis.asyncio.cluster import RedisCluster

from gateway.redis_client import (
    NO_ACCESS,
    OWNED_LUA,
    KeyRepairs,
    RedisAccess,
    channel_messages,
    make_client,
    redis_call,
)
from gateway.residency.store import StoreUnavailable
from gateway.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# A pod's host name is its name: with the process id, unique among gateways sharing a Redis.
GATEWAY_ID = f"{socket.gethostname()}-{os.getpid()}"
HEARTBEAT_S = 5.0
ALIVE_S = 3 * HEARTBEAT_S  # a gateway not seen for this long is not waited for

Answer = dict[str, Any]

# Both scripts begin with this: the members key of another type than the gateway writes (someone SET a string
# there) is deleted, read as no gateway yet, and the next heartbeats write it again. Its WRONGTYPE was every
# heartbeat's and every reload's (StoreUnavailable): no reload reached another gateway, none listed missing.
_OWNED = OWNED_LUA + "owned(1, 'zset')\n"

# KEYS: the members set; ARGV: this gateway's id, how long (s) a silent member is kept. Scores the heartbeat and
# prunes on Redis' clock, in one script: every gateway reads the set by the same clock. Returns OWNED_LUA's repaired.
_BEAT = """
local now = redis.call('TIME')
local seconds = tonumber(now[1]) + tonumber(now[2]) / 1e6
redis.call('ZADD', KEYS[1], seconds, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', seconds - tonumber(ARGV[2]))
return repaired
"""

# KEYS: the members set; ARGV: the alive window (s). {the members whose last heartbeat, on Redis' clock, is within
# it, repaired}.
_ALIVE = """
local now = redis.call('TIME')
local seconds = tonumber(now[1]) + tonumber(now[2]) / 1e6
return {redis.call('ZRANGEBYSCORE', KEYS[1], seconds - tonumber(ARGV[1]), '+inf'), repaired}
"""


class Fanout:
    def __init__(
        self,
        redis_url: str,
        reload_here: Callable[[], Awaitable[Answer]],
        *,
        operation_timeout_s: float,
        cluster: bool = False,
        answer_wait_s: float = 30.0,
        prefix: str = "tg",
        access: RedisAccess = NO_ACCESS,
        repairs: Counter | None = None,
    ) -> None:
        self._reload_here = reload_here
        self._repairs = KeyRepairs("reload_fanout", repairs)
        self._timeout_s = operation_timeout_s
        self._closing = False  # the loops stop retrying: a cancellation they lost cannot keep them alive
        self._answer_wait_s = answer_wait_s  # a reload builds and warms a fleet: allow it seconds
        self._client = make_client(redis_url, operation_timeout_s, cluster=cluster, access=access)
        self._subscriber = make_client(redis_url, operation_timeout_s, subscriber=True, cluster=cluster, access=access)
        self._channel = f"{prefix}:reload"
        self._members = f"{prefix}:gateways"
        self._beat = self._client.register_script(_OWNED + _BEAT)
        self._alive = self._client.register_script(_OWNED + _ALIVE)

    async def running(self, app: web.Application) -> AsyncIterator[None]:
        """The app's cleanup context: follow the channel and keep this gateway's heartbeat while it serves."""
        tasks = [
            asyncio.create_task(self._follow(), name="reload fan-out"),
            asyncio.create_task(self._heartbeat(), name="gateway heartbeat"),
        ]
        yield
        self._closing = True
        await cancel_and_wait(tasks)
        with contextlib.suppress(StoreUnavailable):  # gone at once, rather than waited for until it ages out
            async with redis_call("gateway leave", self._timeout_s):
                await self._client.zrem(self._members, GATEWAY_ID)
        await self._client.aclose()
        await self._subscriber.aclose()

    async def everywhere(self, own: Answer) -> dict[str, Any]:
        """Ask every other live gateway to reload; their answers and ``own``, and who did not answer in time."""
        reply = f"{self._channel}:{uuid.uuid4().hex}"
        answers = [own]
        async with redis_call("live gateways", self._timeout_s):
            alive, repaired = await cast(Awaitable[list[Any]], self._alive(keys=[self._members], args=[ALIVE_S]))
        self._repairs.note(repaired)
        waiting = set(alive) - {GATEWAY_ID}
        if waiting:
            if isinstance(self._subscriber, RedisCluster):
                await self._subscriber.initialize()
            async with self._subscriber.pubsub() as pubsub:
                await pubsub.subscribe(reply)  # before asking: no answer can come before we listen
                async with redis_call("reload publish", self._timeout_s):
                    await self._client.publish(self._channel, json.dumps({"from": GATEWAY_ID, "reply": reply}))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._answer_wait_s):
                        async for message in pubsub.listen():
                            if message.get("type") != "message" or (answer := _request(message["data"])) is None:
                                continue
                            if not isinstance(answer.get("gateway"), str):  # it is looked up in a set just below
                                log.warning("reload fan-out: an answer names no gateway: %.200r", message["data"])
                                continue
                            answers.append(answer)
                            waiting.discard(answer.get("gateway"))
                            if not waiting:
                                break
        return {"gateways": sorted(answers, key=lambda a: str(a.get("gateway"))), "missing": sorted(waiting)}

    async def _follow(self) -> None:
        while True:
            try:
                async for message in channel_messages(self._subscriber, self._channel):
                    if message.get("type") == "message" and (request := _request(message["data"])) is not None:
                        await self._answer(request)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: follow again shortly (a reload meanwhile reaches this one later)
                if self._closing:  # a cancellation lost in the call: nothing else would end this loop
                    return
                log.warning("reload fan-out: not following (%s); retrying", exc)
                await asyncio.sleep(1.0)

    async def _answer(self, request: dict[str, Any]) -> None:
        if request.get("from") == GATEWAY_ID or not isinstance(request.get("reply"), str):
            return
        log.info("reload asked by gateway %s", request.get("from"))
        answer = await self._reload_here()
        async with redis_call("reload answer", self._timeout_s):
            await self._client.publish(request["reply"], json.dumps(answer))

    async def _heartbeat(self) -> None:
        while not self._closing:
            try:
                await self.beat()
            except StoreUnavailable as exc:
                log.debug("gateway heartbeat skipped: %s", exc)
            await asyncio.sleep(HEARTBEAT_S)

    async def beat(self) -> None:
        """One heartbeat: this gateway scored alive on Redis' clock (StoreUnavailable on failure)."""
        async with redis_call("gateway heartbeat", self._timeout_s):
            repaired = await cast(
                Awaitable[list[str]], self._beat(keys=[self._members], args=[GATEWAY_ID, 10 * ALIVE_S])
            )
        self._repairs.note(repaired)


def _request(data: str) -> dict[str, Any] | None:
    """A message off a channel (a request, or an answer) as an object; None (logged) for anything else, which must
    not end the subscription or the reload (another version's message, or anyone's with Redis access)."""
    try:
        request = json.loads(data)
    except (ValueError, RecursionError):  # the last: nested past the parser's depth
        request = None
    if not isinstance(request, dict):
        log.warning("reload fan-out: unreadable message %.200r", data)
        return None
    return request


FANOUT = web.AppKey("fanout", Fanout)
