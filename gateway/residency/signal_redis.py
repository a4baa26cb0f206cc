"""The slot signal's transport (gateway/residency/signal.py): Redis pub/sub on ``{prefix}:slots``.

Every gateway sharing the Redis subscribes to the one channel and publishes there; a Redis Cluster forwards a
PUBLISH to every node's subscribers, so the same works there (one channel: sharded pub/sub would buy nothing at a
message per wait and release). The subscriber reconnects after ``RECONNECT_S`` when its connection drops; while it
is down the signal says so (``SlotSignal.listening``) and waits fall back on the in-use window.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.observe.metrics import GatewayMetrics
from gateway.redis_client import NO_ACCESS, RedisAccess, channel_messages, make_client, redis_call
from gateway.residency.signal import RENEW_S, SHARE_S, SlotSignal
from gateway.tasks import cancel_and_wait

log = logging.getLogger(__name__)

RECONNECT_S = 0.5
# The subscription is pinged after this long without a message, and taken as dropped after as long again without
# an answer. With the connection-wide 15 s (redis_client.QUIET_S) a Redis that froze (SIGSTOP, a hung host) left
# the signal saying it listened, and tenantgate_adapter_slot_signal_up at 1, for 15-30 s while nothing came: the
# lifecycle trusted the others' in-flight news (REMOTE_TTL_S, 1.5 s) long after it stopped. At most a ping a second
# per gateway, and none while the channel carries messages.
QUIET_S = 2 * RENEW_S


class RedisSlotChannel:
    def __init__(
        self,
        url: str,
        metrics: GatewayMetrics,
        *,
        operation_timeout_s: float,
        prefix: str = "tg",
        cluster: bool = False,
        access: RedisAccess = NO_ACCESS,
    ) -> None:
        self._timeout_s = operation_timeout_s
        self._client = make_client(url, operation_timeout_s, cluster=cluster, access=access)
        self._subscriber = make_client(url, operation_timeout_s, subscriber=True, cluster=cluster, access=access)
        self._channel = f"{prefix}:slots"
        self.signal = SlotSignal(self._publish, metrics)
        self._stopping = False

    async def _publish(self, body: str) -> None:
        async with redis_call("slot signal publish", self._timeout_s):
            await self._client.publish(self._channel, body)

    async def run(self) -> None:
        """Follow the channel and renew this gateway's waits until cancelled."""
        timers = [
            asyncio.create_task(self._every(RENEW_S, self.signal.renew), name="slot signal renewal"),
            asyncio.create_task(self._share(), name="in-flight adapters shared"),
        ]
        try:
            await self._follow()
        finally:
            await cancel_and_wait(timers)

    def stop(self) -> None:
        """Before ``run`` is cancelled: the subscription stops retrying, so a cancellation lost in a Redis call
        cannot keep it alive."""
        self._stopping = True

    async def close(self) -> None:
        await self.signal.close()
        await self._client.aclose()
        await self._subscriber.aclose()

    async def _follow(self) -> None:
        while True:
            try:
                async for message in channel_messages(self._subscriber, self._channel, QUIET_S):
                    if message.get("type") == "subscribe":
                        self.signal.subscribed(True)
                    elif message.get("type") == "message":
                        self.signal.heard(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away, or the connection dropped: subscribe again shortly
                if self._stopping:
                    return
                log.debug("slot signal: subscription lost: %r", exc)
            self.signal.subscribed(False)
            await asyncio.sleep(RECONNECT_S)

    async def _share(self) -> None:
        """The in-flight adapters shared every ``SHARE_S`` while there is something to say, else nothing until a
        request is in flight or a load under way (then within ``SHARE_S`` of it, as before)."""
        while True:
            await asyncio.sleep(SHARE_S)
            if not self.signal.share():
                await self.signal.until_flying()

    @staticmethod
    async def _every(interval_s: float, work: Callable[[], None]) -> None:
        while True:
            await asyncio.sleep(interval_s)
            work()
