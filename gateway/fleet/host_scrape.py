"""Under ``serve --workers``: the engines' /metrics are scraped, and their health probed, once per host, not once per
worker.

One worker leads: the one holding an exclusive ``flock`` on the supervisor's directory's ``scrapes.lock``. Each
worker waits for that lock in a thread of its own (a blocking ``flock``: no polling), so when the leader dies the
kernel releases its lock and one waiting worker takes over at once; the first to start leads until then. The
leader scrapes as a single gateway does, every interval, and after each pool's scrape sends the parsed load view
(one datagram per pool, compressed: some 50 bytes per replica) to every other worker's Unix datagram socket in
that directory, through a socket per sibling. A worker that receives it takes it as its own scrape, stamped with
the leader's clock (``time.monotonic`` is the host's), and counts its own requests in flight at that moment: its
load view is then the engine's figure plus this worker's own change since, as after a scrape of its own
(``Replica.load_view``). Nothing changes when the
leader is slow or gone: the view goes stale after three intervals and routing falls back to the worker's own count,
visibly (``tenantgate_engine_scrape_age_seconds``).

Health probes go the same way: the leader probes every replica each ``health.interval_s`` and sends each pool's
results (URL probed: answered healthy) to the others, which take them as their own probe (thresholds and the welcome
back stay each worker's own bookkeeping, on the same results); a replica no round names (the workers' discovery or
config differing for a while) is probed by the worker that has it. A follower that has heard no probe round of a pool
for three rounds' time (``3 x (interval_s + timeout_s)``) probes it itself until the leader's come again, so a
leader that is alive but not probing (stopped, its loop stuck, a reload that dropped the pool) never leaves the
others blind. Each worker probing every replica itself was, at 4 replicas and 0.5 s, 8 requests a second per
worker through aiohttp's client and as many for the replicas to answer, on the cores the requests are served from.

Why not the supervisor or Redis: the supervisor holds no fleet (no drivers, no discovery, no reloads) and would
have to grow one; Redis would add a write per interval and a read per interval per worker, and a lag of up to an
interval between the scrape and each worker's read (a worker's own change in that lag is then lost from its view).
A datagram arrives within microseconds and wakes only the workers, once per scrape.

The socket lives in the supervisor's directory (mode 0700), yet what arrives is checked as input, not trusted: a
datagram that inflates past ``_MAX_MESSAGE``, nests past the parser, carries a figure that is not a finite number
of the right kind or a probe result that is not a boolean, or is stamped ahead of the host's clock, is ignored
(the first said, then a count each minute), and one no newer than the last taken for its pool (replayed, or late)
is not taken: it reaches neither the load view nor the replicas' health.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import logging
import math
import os
import socket
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from backends.base import EngineLoad
from gateway.workers import WorkerSockets

log = logging.getLogger(__name__)

# What a worker does with a scrape its leader sent: (pool, when it answered (time.monotonic), loads by replica).
Apply = Callable[[str, float, dict[str, EngineLoad | None]], None]
# What a worker does with a probe round its leader sent: (pool, healthy by the URL probed).
ApplyProbes = Callable[[str, dict[str, bool]], None]
_LOCK = "scrapes.lock"
_SOCKET = "scrapes"
_MAX_DATAGRAM = 1 << 20  # what one receive takes; a larger datagram is refused by the sender (logged there)
# Why compressed, and a socket per sibling: a Unix datagram may not exceed its socket's send buffer (about 208 KiB by
# default), and every datagram not yet read counts against the sending socket's buffer. Plain JSON (250-300 bytes
# per replica) was refused whole past some 800 replicas, and one socket sending to several siblings ran out of room
# once the first few held a datagram each (the others missed the scrape). zlib at level 1: 0.3 ms for 1,000 replicas.
_LEVEL = 1
UNREADABLE_LOG_S = 60.0
_PROBES = "probes"  # a message's kind: a probe round (a scrape has no kind: what every worker sent before probes)
# A sibling that cannot take a datagram now: not started yet, dead, being replaced, or its queue is full (busy).
_GONE = (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN, errno.ENOBUFS)


def encode(pool: str, at: float, worker: int, loads: Mapping[str, EngineLoad | None]) -> bytes:
    replicas = {
        replica: None if load is None else {**asdict(load), "running_adapters": sorted(load.running_adapters)}
        for replica, load in loads.items()
    }
    return zlib.compress(json.dumps({"pool": pool, "at": at, "worker": worker, "replicas": replicas}).encode(), _LEVEL)


def encode_probes(pool: str, worker: int, healthy: Mapping[str, bool], at: float) -> bytes:
    """``at``: when the round ended (``time.monotonic``): a worker takes only rounds newer than the last it took."""
    round_ = {"kind": _PROBES, "pool": pool, "worker": worker, "healthy": healthy, "at": at}
    return zlib.compress(json.dumps(round_).encode())


# What a datagram may inflate to: a scrape takes some 300 bytes per replica, so about 50,000 replicas. A datagram of
# under 1 MiB (what one receive takes) inflated a thousandfold before: a gigabyte, then parsed, on the event loop.
_MAX_MESSAGE = 16 << 20
# How far ahead of this host's clock a message's ``at`` may be (the siblings share ``time.monotonic``): none is
# ahead but by the time the datagram took.
_AHEAD_S = 1.0
_LOAD_FIELDS = frozenset(("running", "waiting", "kv_cache_usage", "running_adapters", "gpu_slots", "generated_tokens"))


def _message(data: bytes) -> dict[str, Any]:
    """A datagram as the object a sibling sends; ValueError for anything else (never another error: the reader's
    handling is for ValueError, KeyError, TypeError and AttributeError)."""
    inflate = zlib.decompressobj()
    try:
        text = inflate.decompress(data, _MAX_MESSAGE)
    except zlib.error as exc:
        raise ValueError(f"not a compressed message: {exc}") from exc
    if inflate.unconsumed_tail:
        raise ValueError(f"a message larger than {_MAX_MESSAGE} bytes once decompressed")
    try:
        message = json.loads(text)
    except RecursionError as exc:  # nested past the parser's depth
        raise ValueError("a message nested too deep") from exc
    if not isinstance(message, dict):
        raise ValueError("a message that is not an object")
    return message


def _figure(value: Any, what: str, *, whole: bool = False) -> float:
    """A figure a scrape carries: a JSON number (not a boolean), finite, not negative (``whole``: an integer)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or (whole and not isinstance(value, int)):
        raise ValueError(f"{what} is not a number: {value!r}")
    try:
        figure = float(value)
    except OverflowError as exc:  # an integer past a double
        raise ValueError(f"{what} is past a double") from exc
    if not 0 <= figure < math.inf:  # NaN fails it too
        raise ValueError(f"{what} is not a figure: {value!r}")
    return figure


def _at(message: dict[str, Any]) -> float:
    at = _figure(message["at"], "at")
    if at > time.monotonic() + _AHEAD_S:
        raise ValueError(f"a message from the future: at {at}")
    return at


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{what} is not a string: {value!r}")
    return value


def decode(data: bytes) -> tuple[str, float, int, dict[str, EngineLoad | None]]:
    """(pool, at, the worker that scraped, loads); ValueError (KeyError, TypeError) on what no sibling sends."""
    return _scrape(_message(data))


def decode_probes(data: bytes) -> tuple[str, int, dict[str, bool]]:
    """(pool, the worker that probed, healthy by the URL probed); ValueError (KeyError, TypeError) as ``decode``."""
    message = _message(data)
    if message.get("kind") != _PROBES:
        raise ValueError("not a probe round")
    return _probes(message)


def _probes(message: dict[str, Any]) -> tuple[str, int, dict[str, bool]]:
    """A probe round's pool, worker and results; a result that is not a boolean makes the round unreadable (read
    as truthy or not, a null or "no" counted as a failed or passed probe: a few such rounds ejected a replica)."""
    healthy = message["healthy"]
    if not isinstance(healthy, dict) or not all(isinstance(ok, bool) for ok in healthy.values()):
        raise ValueError(f"a probe round's results are not booleans by URL: {healthy!r:.200}")
    return _name(message["pool"], "pool"), int(_figure(message["worker"], "worker", whole=True)), healthy


def _load(load: Any) -> EngineLoad:
    """A replica's load as a sibling encodes it (``encode``): every field checked, none taken on trust (a string
    or an integer past a double raised out of the pool's scrape handling, a negative or boolean figure was routed
    on)."""
    if not isinstance(load, dict) or set(load) != _LOAD_FIELDS:
        raise ValueError(f"a replica's load is not the fields a scrape has: {load!r:.200}")
    adapters = load["running_adapters"]
    if not isinstance(adapters, list) or not all(isinstance(adapter, str) for adapter in adapters):
        raise ValueError("a replica's running adapters are not a list of names")
    slots, generated = load["gpu_slots"], load["generated_tokens"]
    return EngineLoad(
        _figure(load["running"], "running"), _figure(load["waiting"], "waiting"),
        _figure(load["kv_cache_usage"], "kv_cache_usage"), frozenset(adapters),
        gpu_slots=None if slots is None else int(_figure(slots, "gpu_slots", whole=True)),
        generated_tokens=None if generated is None else _figure(generated, "generated_tokens"),
    )  # fmt: skip


def _scrape(message: dict[str, Any]) -> tuple[str, float, int, dict[str, EngineLoad | None]]:
    replicas = message["replicas"]
    if not isinstance(replicas, dict):
        raise ValueError("a scrape's replicas are not an object")
    loads = {replica: None if load is None else _load(load) for replica, load in replicas.items()}
    worker = int(_figure(message["worker"], "worker", whole=True))
    return _name(message["pool"], "pool"), _at(message), worker, loads


class HostScrapes:
    """This worker's part: lead (scrape and publish) or follow (take the leader's scrapes)."""

    def __init__(self, sockets: WorkerSockets) -> None:
        self.sockets = sockets
        self.leading = False
        self._inbox: socket.socket | None = None
        self._outboxes: dict[int, socket.socket] | None = None  # one per sibling (see _LEVEL), once started
        self._apply: Apply | None = None
        self._apply_probes: ApplyProbes | None = None
        # When (time.monotonic) each pool's latest probe round came from the leader, and the URLs it probed.
        self._probed_at: dict[str, float] = {}
        self._probed: dict[str, frozenset[str]] = {}
        # Per pool, the ``at`` of the newest scrape and probe round taken: an older one (replayed, or arriving after
        # a newer one) is not taken. A replayed round saying a replica is down counted as another failed probe.
        self._newest_scrape: dict[str, float] = {}
        self._newest_round: dict[str, float] = {}
        # Unreadable datagrams: the first logged, then a count at most every UNREADABLE_LOG_S (a flood of junk cost
        # a log line each).
        self._unreadable = 0
        self._unreadable_logged_at = -math.inf
        self._lock_fd: int | None = None
        self._too_large_logged = False

    async def start(self, apply: Apply, apply_probes: ApplyProbes) -> None:
        """Listen for the leader's scrapes and probe rounds (``apply`` and ``apply_probes`` take each one) and start
        waiting to lead."""
        self._apply, self._apply_probes = apply, apply_probes
        path = self.sockets.socket_path(_SOCKET)
        path.unlink(missing_ok=True)  # a previous worker with this number left it
        inbox = self._inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        inbox.bind(str(path))
        inbox.setblocking(False)
        self._outboxes = {}
        loop = asyncio.get_running_loop()
        loop.add_reader(inbox.fileno(), self._received)
        threading.Thread(target=self._wait_to_lead, args=(loop,), name="scrape leader", daemon=True).start()

    def _wait_to_lead(self, loop: asyncio.AbstractEventLoop) -> None:
        """In a thread: block until this worker holds the host's scrape lock (held until the process exits)."""
        fd = os.open(self.sockets.directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self._lock_fd = fd
        loop.call_soon_threadsafe(self._lead)

    def _lead(self) -> None:
        self.leading = True
        log.info("worker %d scrapes the engines for every worker on this host", self.sockets.worker)

    def probes_heard(self, pool: str, within_s: float) -> bool:
        """Whether the leader's probe round of ``pool`` came within the last ``within_s`` (else probe it here)."""
        return time.monotonic() - self._probed_at.get(pool, -math.inf) <= within_s

    def probes_named(self, pool: str) -> frozenset[str]:
        """The URLs the leader's latest probe round of ``pool`` probed (a replica at another is this worker's to
        probe)."""
        return self._probed.get(pool, frozenset())

    def publish(self, pool: str, at: float, loads: Mapping[str, EngineLoad | None]) -> None:
        """Send one pool's scrape to every other worker (non-blocking; a sibling that cannot take it now misses it:
        its view goes stale after three intervals unless the next scrape reaches it)."""
        self._send(pool, "scrape", encode(pool, at, self.sockets.worker, loads))

    def publish_probes(self, pool: str, healthy: Mapping[str, bool]) -> None:
        """Send one pool's probe round to every other worker (as ``publish``; one that misses it probes the pool
        itself once the leader's rounds have not come for a while: ``probes_heard``)."""
        self._send(pool, "probe round", encode_probes(pool, self.sockets.worker, healthy, time.monotonic()))

    def _send(self, pool: str, what: str, data: bytes) -> None:
        outboxes = self._outboxes
        if outboxes is None:
            return
        for sibling in self.sockets.siblings():
            outbox = outboxes.get(sibling)
            if outbox is None:
                outbox = outboxes[sibling] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                outbox.setblocking(False)
            try:
                outbox.sendto(data, str(self.sockets.socket_path(_SOCKET, sibling)))
            except OSError as exc:
                if exc.errno == errno.EMSGSIZE and not self._too_large_logged:
                    self._too_large_logged = True
                    log.error("pool %s's %s (%d bytes) is too large to share: each worker reads the engines "
                              "itself or routes on its own count", pool, what, len(data))  # fmt: skip
                elif exc.errno not in _GONE and exc.errno != errno.EMSGSIZE:
                    log.warning("sharing pool %s's %s with worker %d failed: %s", pool, what, sibling, exc)

    def _received(self) -> None:
        inbox, apply, apply_probes = self._inbox, self._apply, self._apply_probes
        assert inbox is not None and apply is not None and apply_probes is not None
        while True:
            try:
                data = inbox.recv(_MAX_DATAGRAM)
            except BlockingIOError:
                return
            try:
                message = _message(data)
                if message.get("kind") == _PROBES:
                    pool, _, healthy = _probes(message)
                    at = _at(message)
                    # A leader that just took over may still receive its predecessor's last round.
                    if not self.leading and at > self._newest_round.get(pool, -math.inf):
                        self._newest_round[pool] = at
                        self._probed_at[pool], self._probed[pool] = time.monotonic(), frozenset(healthy)
                        apply_probes(pool, healthy)
                    continue
                pool, at, _, loads = _scrape(message)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                self._unreadable_message(exc)
                continue
            # A leader that just took over may still receive its predecessor's last one.
            if not self.leading and at > self._newest_scrape.get(pool, -math.inf):
                self._newest_scrape[pool] = at
                apply(pool, at, loads)

    def _unreadable_message(self, exc: Exception) -> None:
        self._unreadable += 1
        now = time.monotonic()
        if now - self._unreadable_logged_at >= UNREADABLE_LOG_S:
            log.warning("an unreadable message from a sibling worker was ignored (%d since the last said): %s",
                        self._unreadable, exc)  # fmt: skip
            self._unreadable, self._unreadable_logged_at = 0, now

    def close(self) -> None:
        if self._inbox is not None:
            asyncio.get_running_loop().remove_reader(self._inbox.fileno())
            self._inbox.close()
            self.sockets.socket_path(_SOCKET).unlink(missing_ok=True)
        for outbox in (self._outboxes or {}).values():
            outbox.close()
