"""Home reservations: each recently active key holds one slot at its home replica while it has nothing in flight.

Why: bounded loads alone let a hot key's overflow fill its home and ring neighbours right up to the cap, and the
cap moves with every arrival and completion, so a light key arriving at its home a moment later finds it full and
spills too. A reservation is a placement made in advance: it counts as load for everyone else (so the hot key
stops one slot short for each active neighbour) and its owner may always take it (so the light key goes home).
Taking or giving back a reservation leaves a replica's effective load (in flight + reserved) unchanged, which is
why the bound still holds over effective load at every placement.

Reservations bind keys that already have a request in flight (a hot key's overflow); a key with nothing in flight
is not hot, so it is checked against requests in flight only, which keeps an idle fleet's reservations from
turning a newcomer away from its home. A key is active while it has a request in flight or sent or finished one
within ``window_s``; after that its reservation lapses. The bookkeeping is O(1) per request: keys live in an
OrderedDict by last activity, and lapsed ones are dropped from its front on each call.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable

from gateway.routing.decision import NEW_KEY, KeyStanding

_IDLE_HOLDING = KeyStanding(0, holds_reservation=True)


class Reservation:
    """One active key's reservation state, read and written on every request of it. A base class: the pool's
    per-key entry (gateway/fleet/keys.py's KeyEntry) is one, and the pool hands it to ``arrived``, so a key's first
    request makes no object of its own here (a dataclass's ``__init__`` was a Python call at every first sight, and
    its object 64 bytes more per key)."""

    __slots__ = ("home", "in_flight", "in_flight_at_home", "last_active")

    home: str
    in_flight: int
    in_flight_at_home: int
    last_active: float


class HomeReservations:
    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self.clock = clock
        # The active keys' states, the least recently active first (the pool's one pass reads a key's here: see
        # ``standing``).
        self.active: OrderedDict[str, Reservation] = OrderedDict()
        # No key lapses before this (clock time): the front key's last activity plus the window, when ``expire`` last
        # looked. Keys only move to the back with a later activity, so the front's (the oldest) only grows and this
        # stays a lower bound: ``expire`` is one comparison until then (the pool makes it before calling, at every
        # decision: a call to find nothing due cost about 550 instructions).
        self.quiet_until = -math.inf
        # Slots held per replica, read per candidate per decision: a defaultdict, so the reader indexes it (a
        # replica never reserved reads 0) rather than calling get; see ``reserved``.
        self.by_replica: defaultdict[str, int] = defaultdict(int)

    @property
    def enabled(self) -> bool:
        return self.window_s > 0

    def reserved(self, replica_id: str) -> int:
        """Slots held at ``replica_id`` for active keys homed there with nothing in flight."""
        return self.by_replica.get(replica_id, 0)

    def standing(self, key: str) -> KeyStanding:
        """``key``'s requests in flight and whether it holds its home reservation now (call after ``expire``)."""
        state = self.active.get(key)
        if state is None:
            return NEW_KEY
        if not state.in_flight:  # the common case, built once: an active key with nothing in flight holds its slot
            return _IDLE_HOLDING
        return KeyStanding(state.in_flight, state.in_flight_at_home == 0)

    def expire(self) -> None:
        """Drop the reservations of keys idle for longer than the window."""
        now = self.clock()
        if now < self.quiet_until:
            return
        deadline = now - self.window_s
        while self.active:
            key, state = next(iter(self.active.items()))
            if state.last_active >= deadline:
                self.quiet_until = state.last_active + self.window_s
                return
            if state.in_flight:  # a long request is activity: keep tracking it, re-check later
                state.last_active = self.clock()
                self.active.move_to_end(key)
                continue
            del self.active[key]
            self.by_replica[state.home] -= 1
        # None left: a key that comes later is active from then on.
        self.quiet_until = now + self.window_s

    def arrived(self, key: str, home: str, chosen: str, fresh: Reservation | None = None) -> None:
        """A request of ``key`` placed on ``chosen`` (its home ``home``). ``fresh``: where the key has no state here
        (its first request, or its first since its reservation lapsed), the object to keep it in (the pool's entry
        for the key, every field set here), else one is made."""
        if self.window_s <= 0:  # not ``enabled``: a property call per request
            return
        state = self.active.get(key)
        if state is None:  # its first request: its reservation is held from now on, taken by this request at home
            at_home = chosen == home
            if fresh is None:
                fresh = Reservation()
            fresh.home, fresh.in_flight, fresh.in_flight_at_home = home, 1, 1 if at_home else 0
            fresh.last_active = self.clock()
            self.active[key] = fresh
            if not at_home:
                self.by_replica[home] += 1
            return
        state.last_active = self.clock()
        self.active.move_to_end(key)
        state.in_flight += 1
        if chosen == state.home:
            if state.in_flight_at_home == 0:
                self.by_replica[state.home] -= 1
            state.in_flight_at_home += 1

    def finished(self, key: str, chosen: str) -> None:
        state = self.active.get(key)
        if state is None:  # reservations are off
            return
        state.last_active = self.clock()
        self.active.move_to_end(key)
        state.in_flight -= 1
        if chosen == state.home:
            state.in_flight_at_home -= 1
            if state.in_flight_at_home == 0:
                self.by_replica[state.home] += 1
