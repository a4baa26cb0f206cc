"""Slot releases across gateways: a load waiting for a slot on a replica hears at once when another gateway frees one
(and every gateway hears when another changes a replica's resident set: see below).

Gateways sharing Redis see each other's uses only as use marks, and an adapter counts as in use while its mark is
within the in-use window (``ResidencyConfig.shared_in_use_window_s``): without this module a slot another gateway
frees is seen only when its mark ages out. Nothing here is written on the request path unless some gateway waits:

- a gateway with loads waiting for a slot on replica R announces it (``wait``), and again every ``RENEW_S`` while
  they wait; every gateway keeps the replicas with a remote waiter in a local set whose entries expire;
- a gateway that hears of a wait on R answers with the adapters it has requests in flight for there (``held``, at
  every announcement), and says so again whenever that set changes while the wait lasts; one that frees a slot on
  R (its last request with an adapter there ends, or it unloads one) says so with ``freed``: a release. A gateway
  that holds nothing there and said nothing else since the last answer stays silent: silence is an empty held set
  (so the messages per renewal grow with the gateways that hold something, not with every gateway);
- the waiting gateway keeps each other gateway's held set; a release wakes its waits on R, which look again, and
  so does a held set that lost an adapter (a release that went missing, made good by the answer to the next
  renewal) or one not renewed for ``REMOTE_TTL_S`` (its gateway is gone).

Why held sets and not only releases: a use mark says an adapter was used recently, not that it is in use now. Once
every listening gateway has had ``SETTLE_S`` to answer the announcement, the waiter knows which of R's adapters are
in flight anywhere, so an adapter nobody holds may go at once, whatever its mark. Until then, or while this
gateway's own subscription is down (``listening`` false, the metric ``tenantgate_adapter_slot_signal_up`` 0, a
warning in the log), ``remote_holds`` says None and the lifecycle falls back on the in-use window. A gateway whose
subscription is down does not hear the announcement and cannot answer it: a waiter may then evict an adapter that
gateway still uses. On an engine that refuses loads when full (TensorRT-LLM: the only kind that waits) unloading
is the gateway forgetting the adapter; the engine keeps it while in flight and the next request sends it again.

The same channel carries the news that a replica's resident set changed (``set``: this gateway loaded or unloaded an
adapter there, or the engine's listing corrected the record): every other gateway reads that replica's record again
at once, rather than at its next residency sync (``residency.sync_interval_s``, 2 s). One message per load or
unload, never per request: routing by a record seconds old sends a key where its adapter was just evicted, or away
from where it was just loaded, and each such miss costs a cold load (several gateways then load one adapter on
several replicas). After a load a request waited for, its gateway lets the replica's lock go and says so
(``unlocked``, one message per load): another gateway's load waiting for that lock tries at once, where its polls
of the store's lock (up to 0.2 s apart) took it 77-94 ms after the release on average (the churn trace, three
gateways). The hold before the release (``PoolResidency._settle``) keeps that prompt start from stalling the first
load's requests before their first step.

The channel also carries which adapters each gateway has requests in flight for, per replica (``flying``), so that
every gateway's routing counts an adapter in flight anywhere as on that replica's GPU (``flying_elsewhere``, read by
``PoolResidency.likely_on_gpu``). Without it, a request placed by one gateway where its adapter is cold (the
gateway then loads it: 300-500 ms on a GPU) is invisible to the others until the load ends, and they load the same
adapter on other replicas meanwhile (measured: 6-7 such duplicate loads per 30 s of the hot trace with 3 gateways,
none with one). On an engine that queues for slots (vLLM), the lifecycle's evictions read them too
(``flying_at``): an adapter another gateway has in flight is in use, one it let go is not (after
``FLYING_GRACE_S``), and every adapter a message names, or that its sender let go since, counts as used when it
arrives (``SlotListener.remote_used``): its least recently used adapter is then the engine's. The same message
carries its requests in flight per replica (``load_elsewhere``: what ``routing.load_view: shared`` adds to a
gateway's own count). Batched, never per request: every ``SHARE_S`` a
gateway whose held sets or counts changed since its last message publishes all of them (absolute, so a lost message
is made good by the next; at most ``MAX_SHARED_PAIRS`` entries), and repeats them every ``RENEW_S`` while it holds
something; a gateway that holds nothing says so once, then stays silent (and its timer sleeps until a request or
a load starts). Another gateway's sets not heard again
within ``REMOTE_TTL_S`` are forgotten (it stopped, or died).

The transport is a callable that publishes one message (gateway/residency/signal_redis.py: Redis pub/sub); the
in-process store has ``NO_SIGNAL``, which does nothing: one gateway sees its own releases at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from gateway.observe.metrics import GatewayMetrics
from gateway.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# A waiting gateway announces its wait this often; a remote wait or held set not heard again for REMOTE_TTL_S is
# forgotten (its gateway stopped waiting, or died).
RENEW_S = 0.5
REMOTE_TTL_S = 3 * RENEW_S
# After an announcement reached Redis, the time every listening gateway has to answer with its held set: a round
# trip through Redis and an event loop's turn, with room for a busy loop. A wait may end this much after a release.
SETTLE_S = 0.05
# A gateway whose in-flight adapters changed says so at most this often (batched: the request path writes nothing,
# share compares a snapshot with the last message), in one message of at most MAX_SHARED_PAIRS entries.
SHARE_S = 0.05
MAX_SHARED_PAIRS = 4096
# On an engine that queues for slots (vLLM), a gateway hearing the others' in-flight adapters counts as in use only
# those, its own, and adapters used within this long: a request another gateway began since its last message (at
# most SHARE_S old, plus the message's way through Redis). The in-use window (a second) stands in while not listening.
FLYING_GRACE_S = 2 * SHARE_S
MAX_COUNT = 1_000_000  # a replica's requests in flight at one gateway, as a receiver believes them at most

Key = tuple[str, str]  # (pool, replica)
# A replica's adapter loads under way at one gateway, or at the others together: how many are queued for its lock,
# and when (time.monotonic) the one the engine runs began, or None (routing/costs.py's ``Loading``, which routing
# reads: residency may not import routing).
Loading = tuple[int, float | None]
_NOWHERE: frozenset[str] = frozenset()
_NO_LOAD: Mapping[str, int] = MappingProxyType({})
_NO_LOADING: Mapping[str, Loading] = MappingProxyType({})


class SlotListener(Protocol):
    """A pool's lifecycle, as the signal sees it."""

    def held_here(self, replica_id: str) -> frozenset[str]:
        """The adapters this gateway has requests in flight for on the replica."""
        ...

    def remote_release(self, replica_id: str) -> None:
        """Another gateway freed a slot on the replica (or held sets may now be complete): waits look again."""
        ...

    def remote_set_changed(self, replica_id: str) -> None:
        """Another gateway changed the replica's resident set: read its record again."""
        ...

    def remote_unlocked(self, replica_id: str) -> None:
        """Another gateway's load let the replica's lock go: a wait for it tries again now."""
        ...

    def flying(self) -> Iterator[tuple[str, frozenset[str], int]]:
        """Per replica where this gateway has requests in flight, their adapters and how many requests."""
        ...

    def remote_used(self, replica_id: str, adapters: Collection[str]) -> None:
        """Another gateway has, or had until now, requests in flight for these adapters on the replica: they were
        used now (fresher than its use marks, flushed to the store only every ``use_flush_interval_s``)."""
        ...


@dataclass
class _Wait:
    """This gateway's loads waiting on one replica, and what the other gateways said they hold there."""

    count: int = 0
    left_at: float = 0.0  # monotonic; when the count last fell to 0 (kept a while: a load looks again, then waits on)
    sent_at: float = float("-inf")  # monotonic; when it was last announced
    announced_at: float | None = None  # monotonic; the first announcement that reached Redis while listening
    holds: dict[str, tuple[frozenset[str], float]] = field(default_factory=dict)  # gateway -> (held, heard at)
    last: dict[str, int] = field(default_factory=dict)  # gateway -> number of its newest held set heard


def _uncount(counts: dict[str, int], name: str, by: int = 1) -> None:
    """Take ``by`` off ``name``'s count, forgetting it once nothing is left (the tallies of other gateways' news)."""
    if counts[name] > by:
        counts[name] -= by
    else:
        del counts[name]


class SlotSignal:
    def __init__(
        self,
        publish: Callable[[str], Awaitable[None]],
        metrics: GatewayMetrics,
        *,
        gateway_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``publish``: sends one message to every gateway (this one included); raises on failure."""
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self._publish = publish
        self.metrics = metrics
        self._clock = clock
        self._listeners: dict[str, list[SlotListener]] = {}
        self._waits: dict[Key, _Wait] = {}
        self._remote_waits: dict[Key, float] = {}  # (pool, replica) -> until when (monotonic) another gateway waits
        # Replicas where this gateway's last held message named adapters: it answers the next wait there even when
        # it holds nothing now (else silent).
        self._said_held: set[Key] = set()
        self._sending: set[asyncio.Task[None]] = set()
        # Numbers this gateway's messages: publishes run concurrently and may reach Redis out of order, so a
        # waiter keeps each gateway's newest held set, not the last to arrive.
        self._sent_count = 0
        # This gateway's in-flight adapters and requests as last shared (``share``): what, when, and whether that
        # message named any.
        self._flying_sent: tuple[object, object, object] = ({}, {}, {})
        self._flying_sent_at = float("-inf")
        self._said_flying = False
        # Set while the share timer waits for something to say (``until_flying``).
        self._quiet: asyncio.Future[None] | None = None
        # Other gateways' in-flight adapters and requests: per sender its sets, counts and when heard, the newest
        # message's number, per (pool, adapter) how many senders hold it on each replica, and per pool their
        # requests per replica (what routing reads: one lookup a decision).
        self._flying_from: dict[str, tuple[dict[Key, frozenset[str]], dict[Key, int], float, dict[Key, Loading]]] = {}
        self._load: dict[str, dict[str, int]] = {}
        # Adapter loads under way (routing's load_ahead term, routing/costs.py): this gateway's per replica, as its
        # lifecycles say (``loading``), and the other gateways' per pool and replica, summed over them (their
        # queued loads added, the earliest running one kept).
        self._loading_here: dict[Key, Loading] = {}
        self._loading: dict[str, dict[str, Loading]] = {}
        self._flying_n: dict[str, int] = {}
        self._flying: dict[tuple[str, str], dict[str, int]] = {}
        # The same per (pool, replica): each adapter the others have in flight there, by how many of them hold it
        # (routing's gpu_slot term counts the adapters in use on a replica: one lookup per candidate).
        self._flying_here: dict[Key, dict[str, int]] = {}
        self.listening = False  # this gateway's subscription is up: it hears the others
        # After the subscription came back, what the others hold is not all heard again until then (flying_at):
        # each says it again within RENEW_S.
        self._heard_all_at = 0.0
        self._listened = False  # the subscription has been up before
        metrics.slot_signal_up.set(0)

    # --- the lifecycle's side -------------------------------------------------------------------------------------

    def attach(self, pool: str, listener: SlotListener) -> Callable[[], None]:
        """Follow a pool's replicas for ``listener`` (a reload's new fleet and the retiring one both do, for a
        while); returns what detaches it."""
        self._listeners.setdefault(pool, []).append(listener)
        return lambda: self._listeners[pool].remove(listener)

    @contextlib.contextmanager
    def waiting(self, pool: str, replica: str) -> Iterator[None]:
        """A load waits for a slot on the replica while inside: the first one announces it, the renewal loop
        (``renew``) repeats it until the last leaves. A load leaves to look again under the lock and comes back if
        there is still no room: the wait is kept for ``RENEW_S`` after the last leaves, announced and with what
        the other gateways hold, rather than announced again and settled again each time."""
        key = (pool, replica)
        wait = self._waits.setdefault(key, _Wait())
        if not wait.count and wait.sent_at <= self._clock() - RENEW_S:  # new, or kept past a renewal it missed
            self._announce(key, wait)
        wait.count += 1
        try:
            yield
        finally:
            wait.count -= 1
            if not wait.count:
                wait.left_at = self._clock()

    def changed(self, pool: str, replica: str, *, freed: bool) -> None:
        """This gateway's held set on the replica changed (``freed``: a slot freed, an adapter's last request here
        ended or it was unloaded). A dict lookup unless another gateway waits there; then one publish."""
        if self._quiet is not None:  # the first request in flight since share had nothing to say
            self._stir()
        if not self._remote_waits or not self.remote_waiting(pool, replica):
            return
        holding = self._held(pool, replica)
        self._send({"t": "held", "p": pool, "r": replica, "a": holding, "freed": freed}, None)
        if holding:
            self._said_held.add((pool, replica))
        if freed:
            self.metrics.slot_releases.labels(pool, "published").inc()

    def set_changed(self, pool: str, replica: str) -> None:
        """This gateway changed the replica's resident set (and wrote it to the store): the others read it again.
        One publish per load or unload."""
        self._send({"t": "set", "p": pool, "r": replica}, None)

    def unlocked(self, pool: str, replica: str) -> None:
        """A load of this gateway let the replica's lock go: another gateway's load waiting for it tries now rather
        than at its next poll (up to 0.2 s apart). One publish per load."""
        self._send({"t": "unlocked", "p": pool, "r": replica}, None)

    def flying_on(self, pool: str, adapter: str) -> Collection[str]:
        """The replicas where another gateway has requests in flight for the adapter (as it last shared them)."""
        return self._flying.get((pool, adapter), _NOWHERE)

    def flying_elsewhere(self, pool: str, replica: str, adapter: str) -> bool:
        """Whether another gateway has requests in flight for the adapter on the replica (as it last shared them)."""
        return replica in self._flying.get((pool, adapter), _NOWHERE)

    def load_elsewhere(self, pool: str) -> Mapping[str, int]:
        """Per replica of the pool, the requests other gateways have in flight there (as they last shared them)."""
        return self._load.get(pool, _NO_LOAD)

    def adapters_elsewhere(self, pool: str, replica: str) -> Mapping[str, int]:
        """The adapters other gateways have requests in flight for on the replica (as they last shared them), each
        with how many of them hold it."""
        return self._flying_here.get((pool, replica), _NO_LOAD)

    def loading(self, pool: str, replica: str, entry: Loading | None) -> None:
        """This gateway's adapter loads on the replica now (None: none): shared with the in-flight adapters, in the
        next ``flying`` message (batched: never a message per load)."""
        if entry is None:
            self._loading_here.pop((pool, replica), None)
        else:
            self._loading_here[(pool, replica)] = entry
            self._stir()

    def loading_elsewhere(self, pool: str) -> Mapping[str, Loading]:
        """Per replica of the pool, the adapter loads other gateways have under way there (as they last shared them:
        their loads queued, and when the one running began on this gateway's clock)."""
        return self._loading.get(pool, _NO_LOADING)

    def flying_at(self, pool: str, replica: str) -> frozenset[str] | None:
        """The adapters other gateways have requests in flight for on the replica, as they last shared them; None
        while this gateway is not listening, or for ``REMOTE_TTL_S`` after its subscription came back (it may have
        missed some, or not heard them again yet: a gateway repeats what it holds only every ``RENEW_S``; judge by
        the in-use window instead)."""
        if not self.listening or self._clock() < self._heard_all_at:
            return None
        key = (pool, replica)
        return frozenset().union(*(sets.get(key, _NOWHERE) for sets, _, _, _ in self._flying_from.values()))

    def share(self) -> bool:
        """Publish this gateway's in-flight adapters and requests per replica if they changed since the last
        message, or again every ``RENEW_S`` while it has any (the transport calls this every ``SHARE_S``): one pass
        over the replicas' in-flight tables, never a message per request. Whether the next call may have something
        to say: False once nothing is in flight or loading and that was said, and then the transport waits in
        ``until_flying`` instead of calling every ``SHARE_S`` (an idle gateway, or the idle worker beside a busy one
        under serve --workers, woke 20 times a second for nothing)."""
        now = self._clock()
        held: dict[str, dict[str, list[str]]] = {}
        counts: dict[str, dict[str, int]] = {}
        pairs = 0
        for pool, listeners in self._listeners.items():
            for listener in listeners:
                for replica, adapters, requests in listener.flying():
                    if pairs + len(adapters) + 1 > MAX_SHARED_PAIRS:
                        continue  # bounded: what does not fit is left out (the receivers keep to it too)
                    held.setdefault(pool, {}).setdefault(replica, []).extend(sorted(adapters))
                    pool_counts = counts.setdefault(pool, {})
                    pool_counts[replica] = pool_counts.get(replica, 0) + requests
                    pairs += len(adapters) + 1
        # Adapter loads under way: compared by when each running one began, sent as how long it has run (the
        # gateways' clocks differ).
        loading = dict(list(self._loading_here.items())[: max(0, MAX_SHARED_PAIRS - pairs)])
        due = self._said_flying and now - self._flying_sent_at >= RENEW_S
        if (held, counts, loading) == self._flying_sent and not due:
            return self._said_flying
        self._flying_sent = (held, counts, loading)
        if not held and not loading and not self._said_flying:
            return False  # silence already says so
        self._flying_sent_at, self._said_flying = now, bool(held or loading)
        loads: dict[str, dict[str, list[float | None]]] = {}
        for (pool, replica), (queued, running) in loading.items():
            ran_ms = None if running is None else round(1000.0 * max(0.0, now - running), 1)
            loads.setdefault(pool, {})[replica] = [queued, ran_ms]
        self._send({"t": "flying", "h": held, "c": counts, "l": loads}, None)
        return True

    async def until_flying(self) -> None:
        """Until this gateway has a request in flight for an adapter, or an adapter load under way, where ``share``
        said it had none: what ends it is ``changed`` (an adapter's first request on a replica) and ``loading``."""
        self._quiet = asyncio.get_running_loop().create_future()
        try:
            await self._quiet
        finally:
            self._quiet = None

    def _stir(self) -> None:
        quiet = self._quiet
        if quiet is not None and not quiet.done():
            quiet.set_result(None)

    def remote_holds(self, pool: str, replica: str) -> frozenset[str] | None:
        """The adapters other gateways hold on the replica, once this gateway waits there and every listening
        gateway has had time to say; None otherwise (judge by the in-use window instead)."""
        wait = self._waits.get((pool, replica))
        now = self._clock()
        if not self.listening or wait is None or wait.announced_at is None or now < wait.announced_at + SETTLE_S:
            return None
        if wait.sent_at < now - 2 * RENEW_S:
            return None  # not renewed lately (kept after its loads left): the others may have stopped saying
        fresh = [held for held, heard_at in wait.holds.values() if heard_at > now - REMOTE_TTL_S]
        return frozenset().union(*fresh)

    # --- the transport's side -------------------------------------------------------------------------------------

    def heard(self, raw: str) -> None:
        """One message from the channel."""
        try:
            message = json.loads(raw)
            kind, sender = message["t"], message["g"]
            if not isinstance(sender, str):  # it keys dicts below: a list there would raise, and end the subscription
                raise TypeError("the sender is not a string")
            key = ("", "") if kind == "flying" else (str(message["p"]), str(message["r"]))
        except (ValueError, KeyError, TypeError, RecursionError):  # the last: nested past the parser's depth
            log.warning("slot signal: unreadable message %.200r", raw)
            return
        if sender == self.gateway_id:
            return
        if kind == "flying":
            number = message.get("n")
            if isinstance(number, int) and number > self._flying_n.get(sender, -1):
                self._flying_n[sender] = number
                self._heard_flying(sender, message.get("h"), message.get("c"), message.get("l"))
        elif kind == "set":
            for listener in self._listeners.get(key[0], ()):
                listener.remote_set_changed(key[1])
        elif kind == "unlocked":
            for listener in self._listeners.get(key[0], ()):
                listener.remote_unlocked(key[1])
        elif kind == "wait":
            self._remote_waits[key] = self._clock() + REMOTE_TTL_S
            # Answered while this gateway holds something there, and once more after it last said it did (a lost
            # release is made good at the next renewal); silent otherwise: silence is an empty held set.
            holding = self._held(*key)
            if holding or key in self._said_held:
                self._send({"t": "held", "p": key[0], "r": key[1], "a": holding, "freed": False}, None)
            if holding:
                self._said_held.add(key)
            else:
                self._said_held.discard(key)
        elif kind == "held":
            wait = self._waits.get(key)
            number = message.get("n")
            if wait is None or not isinstance(number, int) or number <= wait.last.get(sender, -1):
                return  # not waiting there (any more), or older than what that gateway said since
            wait.last[sender] = number
            adapters = message.get("a")
            held = frozenset(map(str, adapters)) if isinstance(adapters, list) else frozenset()
            before = wait.holds.get(sender, (frozenset(), 0.0))[0]
            wait.holds[sender] = (held, self._clock())
            if message.get("freed"):
                self.metrics.slot_releases.labels(key[0], "received").inc()
            if message.get("freed") or before - held:  # a slot freed, or a release this gateway missed
                self._wake(key)

    def subscribed(self, up: bool) -> None:
        """The transport's subscription came up (announce every wait again: what was said while down is lost) or
        went down (held sets may be missing: fall back on the in-use window until announced again)."""
        if up == self.listening:
            return
        self.listening = up
        if up and self._listened:  # what the others held was forgotten when it went down (below)
            self._heard_all_at = self._clock() + REMOTE_TTL_S
        self._listened = self._listened or up
        for sender in list(self._flying_from):  # what was said while down is lost: trust only what comes next
            self._forget_flying(sender)
        self._flying_n.clear()
        self.metrics.slot_signal_up.set(1 if up else 0)
        for key, wait in self._waits.items():
            wait.announced_at, wait.holds, wait.last = None, {}, {}
            if up:
                self._announce(key, wait)
        if up:
            log.info("slot signal: listening to other gateways' slot releases")
        else:
            log.warning("slot signal: not listening; slots other gateways free are seen once their uses age out")

    def renew(self) -> None:
        """Announce every wait again (the transport calls this every ``RENEW_S``); forget the waits left for that
        long, the remote waits expired, and the held sets of gateways that stopped answering (gone: what they held
        is free, so the waits look again)."""
        now = self._clock()
        self._remote_waits = {key: until for key, until in self._remote_waits.items() if until > now}
        for sender in [g for g, (_, _, heard_at, _) in self._flying_from.items() if heard_at <= now - REMOTE_TTL_S]:
            self._forget_flying(sender)
            del self._flying_n[sender]
        self._waits = {key: w for key, w in self._waits.items() if w.count or w.left_at > now - RENEW_S}
        for key, wait in self._waits.items():
            gone = [sender for sender, (_, heard_at) in wait.holds.items() if heard_at <= now - REMOTE_TTL_S]
            if any(wait.holds.pop(sender)[0] for sender in gone):
                self._wake(key)
            if wait.count:
                self._announce(key, wait)

    async def close(self) -> None:
        await cancel_and_wait(self._sending)

    # --- inside -------------------------------------------------------------------------------------------------

    def remote_waiting(self, pool: str, replica: str) -> bool:
        """Whether another gateway waits for a slot on the replica (as last announced, within ``REMOTE_TTL_S``)."""
        until = self._remote_waits.get((pool, replica))
        return until is not None and until > self._clock()

    def _held(self, pool: str, replica: str) -> list[str]:
        held: set[str] = set()
        for listener in self._listeners.get(pool, ()):
            held |= listener.held_here(replica)
        return sorted(held)

    def _heard_flying(self, sender: str, held: object, counted: object, loading: object = None) -> None:
        """Another gateway's in-flight adapters, requests and adapter loads replace what it said before. Entries that
        are not a pool's map of replicas to lists of names (or to request counts, or to a load count and how long the
        running load has run) are left out (another gateway's bug, or anyone with Redis access), as are those past
        ``MAX_SHARED_PAIRS``."""
        sets: dict[Key, frozenset[str]] = {}
        requests: dict[Key, int] = {}
        if isinstance(counted, dict):
            for pool, replicas in counted.items():
                if isinstance(replicas, dict):
                    for replica, count in replicas.items():
                        if isinstance(count, int) and 0 < count <= MAX_COUNT and len(requests) < MAX_SHARED_PAIRS:
                            requests[(pool, replica)] = count
        pairs = len(requests)
        if isinstance(held, dict):
            for pool, replicas in held.items():
                if not isinstance(replicas, dict):
                    continue
                for replica, adapters in replicas.items():
                    if not isinstance(adapters, list) or pairs + len(adapters) > MAX_SHARED_PAIRS:
                        continue
                    names = frozenset(name for name in adapters if isinstance(name, str))
                    if names:
                        sets[(pool, replica)] = names
                        pairs += len(names)
        now = self._clock()
        loads_on: dict[Key, Loading] = {}
        if isinstance(loading, dict):
            for pool, replicas in loading.items():
                if not isinstance(replicas, dict):
                    continue
                for replica, entry in replicas.items():
                    if pairs >= MAX_SHARED_PAIRS or not isinstance(entry, list) or len(entry) != 2:
                        continue
                    queued, ran_ms = entry
                    if not isinstance(queued, int) or not 0 <= queued <= MAX_COUNT:
                        continue
                    if ran_ms is None:
                        loads_on[(pool, replica)] = (queued, None)
                    elif isinstance(ran_ms, int | float) and 0 <= ran_ms <= 3_600_000:
                        loads_on[(pool, replica)] = (queued, now - ran_ms / 1000.0)
                    else:
                        continue
                    pairs += 1
        before = self._flying_from.get(sender, ({}, {}, 0.0, {}))[0]
        self._forget_flying(sender)
        self._flying_from[sender] = (sets, requests, now, loads_on)
        self._sum_loading(loads_on)
        # What it holds, and what it let go since its last message, was in use until now: the lifecycles take that
        # as a use (their least recently used adapter is then the engine's too), within SHARE_S of the fact.
        for (pool, replica), names in {**before, **sets}.items():
            used = names | before.get((pool, replica), _NOWHERE)
            for listener in self._listeners.get(pool, ()):
                listener.remote_used(replica, used)
        for (pool, replica), names in sets.items():
            on_replica = self._flying_here.setdefault((pool, replica), {})
            for name in names:
                counts = self._flying.setdefault((pool, name), {})
                counts[replica] = counts.get(replica, 0) + 1
                on_replica[name] = on_replica.get(name, 0) + 1
        for (pool, replica), count in requests.items():
            loads = self._load.setdefault(pool, {})
            loads[replica] = loads.get(replica, 0) + count

    def _sum_loading(self, keys: Collection[Key]) -> None:
        """The other gateways' loads on these replicas, summed again (``_loading``)."""
        for key in keys:
            pool, replica = key
            queued, running = 0, None
            for _, _, _, loads_on in self._flying_from.values():
                entry = loads_on.get(key)
                if entry is not None:
                    queued += entry[0]
                    if entry[1] is not None and (running is None or entry[1] < running):
                        running = entry[1]
            pool_loading = self._loading.setdefault(pool, {})
            if queued or running is not None:
                pool_loading[replica] = (queued, running)
            else:
                pool_loading.pop(replica, None)
                if not pool_loading:
                    del self._loading[pool]

    def _forget_flying(self, sender: str) -> None:
        sets, requests, _, loads_on = self._flying_from.pop(sender, ({}, {}, 0.0, {}))
        self._sum_loading(loads_on)
        for (pool, replica), count in requests.items():
            loads = self._load[pool]
            _uncount(loads, replica, count)
            if not loads:
                del self._load[pool]
        for (pool, replica), names in sets.items():
            on_replica = self._flying_here[(pool, replica)]
            for name in names:
                counts = self._flying[(pool, name)]
                _uncount(counts, replica)
                if not counts:
                    del self._flying[(pool, name)]
                _uncount(on_replica, name)
            if not on_replica:
                del self._flying_here[(pool, replica)]

    def _announce(self, key: Key, wait: _Wait) -> None:
        wait.sent_at = self._clock()
        self._send({"t": "wait", "p": key[0], "r": key[1]}, key)

    def _wake(self, key: Key) -> None:
        for listener in self._listeners.get(key[0], ()):
            listener.remote_release(key[1])

    def _send(self, message: dict[str, object], announcing: Key | None) -> None:
        """Publish in the background (never awaited on the request path). ``announcing``: a wait announcement;
        once it reached Redis while listening, the held sets are complete after ``SETTLE_S`` (waits look again)."""
        self._sent_count += 1
        body = json.dumps({**message, "g": self.gateway_id, "n": self._sent_count})
        task = asyncio.get_running_loop().create_task(self._sent(body, announcing), name="slot signal publish")
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _sent(self, body: str, announcing: Key | None) -> None:
        listening = self.listening
        try:
            await self._publish(body)
        except Exception as exc:  # the store's own calls report Redis away; a lost message costs a fallback
            log.debug("slot signal: publish failed: %r", exc)
            return
        if announcing is None or not listening or not self.listening:
            return
        wait = self._waits.get(announcing)
        if wait is not None and wait.announced_at is None:
            wait.announced_at = self._clock()
            asyncio.get_running_loop().call_later(SETTLE_S, self._wake, announcing)


class NoSignal:
    """The in-process store's signal: one gateway, which sees its own releases at once."""

    def attach(self, pool: str, listener: SlotListener) -> Callable[[], None]:
        return lambda: None

    @contextlib.contextmanager
    def waiting(self, pool: str, replica: str) -> Iterator[None]:
        yield

    def changed(self, pool: str, replica: str, *, freed: bool) -> None:
        return None

    def set_changed(self, pool: str, replica: str) -> None:
        return None

    def unlocked(self, pool: str, replica: str) -> None:
        return None

    def remote_holds(self, pool: str, replica: str) -> frozenset[str] | None:
        return None

    def flying_on(self, pool: str, adapter: str) -> Collection[str]:
        return _NOWHERE

    def flying_elsewhere(self, pool: str, replica: str, adapter: str) -> bool:
        return False

    def load_elsewhere(self, pool: str) -> Mapping[str, int]:
        return _NO_LOAD

    def adapters_elsewhere(self, pool: str, replica: str) -> Mapping[str, int]:
        return _NO_LOAD

    def loading(self, pool: str, replica: str, entry: Loading | None) -> None:
        return None

    def loading_elsewhere(self, pool: str) -> Mapping[str, Loading]:
        return _NO_LOADING

    def flying_at(self, pool: str, replica: str) -> frozenset[str] | None:
        return None


class Signal(Protocol):
    """What the lifecycle uses: ``SlotSignal`` or ``NoSignal``."""

    def attach(self, pool: str, listener: SlotListener) -> Callable[[], None]: ...

    def waiting(self, pool: str, replica: str) -> contextlib.AbstractContextManager[None]: ...

    def changed(self, pool: str, replica: str, *, freed: bool) -> None: ...

    def set_changed(self, pool: str, replica: str) -> None: ...

    def unlocked(self, pool: str, replica: str) -> None: ...

    def remote_holds(self, pool: str, replica: str) -> frozenset[str] | None: ...

    def flying_on(self, pool: str, adapter: str) -> Collection[str]: ...

    def flying_elsewhere(self, pool: str, replica: str, adapter: str) -> bool: ...

    def load_elsewhere(self, pool: str) -> Mapping[str, int]: ...

    def adapters_elsewhere(self, pool: str, replica: str) -> Mapping[str, int]: ...

    def loading(self, pool: str, replica: str, entry: Loading | None) -> None: ...

    def loading_elsewhere(self, pool: str) -> Mapping[str, Loading]: ...

    def flying_at(self, pool: str, replica: str) -> frozenset[str] | None: ...


NO_SIGNAL = NoSignal()
