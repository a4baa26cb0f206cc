"""Home reservations: the bookkeeping, and the properties that bounded loads keep with them."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing.decision import KeyStanding, ReplicaLoad, RoutingDecision
from gateway.routing.pipeline import decide
from gateway.routing.reservations import HomeReservations
from gateway.routing.ring import Ring
from tests.clock import Clock


def test_a_key_reserves_its_home_between_requests_and_lapses_after_the_window() -> None:
    clock = Clock()
    reservations = HomeReservations(window_s=2.0, clock=clock)
    reservations.arrived("acme", home="r0", chosen="r0")
    assert reservations.reserved("r0") == 0  # in flight at home: it holds the slot itself
    reservations.finished("acme", chosen="r0")
    assert reservations.reserved("r0") == 1 and reservations.standing("acme") == KeyStanding(0, True)
    clock.advance(1.9)
    reservations.expire()
    assert reservations.standing("acme").holds_reservation
    clock.advance(0.2)
    reservations.expire()
    assert reservations.reserved("r0") == 0 and reservations.standing("acme") == KeyStanding()


def test_a_key_that_spilled_still_reserves_its_home() -> None:
    reservations = HomeReservations(window_s=2.0, clock=Clock())
    reservations.arrived("acme", home="r0", chosen="r1")
    assert reservations.reserved("r0") == 1 and reservations.standing("acme") == KeyStanding(1, True)
    reservations.finished("acme", chosen="r1")
    assert reservations.reserved("r0") == 1 and reservations.reserved("r1") == 0


def test_a_request_longer_than_the_window_keeps_the_key_tracked() -> None:
    clock = Clock()
    reservations = HomeReservations(window_s=2.0, clock=clock)
    reservations.arrived("acme", home="r0", chosen="r0")
    clock.advance(10.0)
    reservations.expire()
    reservations.finished("acme", chosen="r0")
    assert reservations.reserved("r0") == 1  # not dropped while in flight, so its completion is still counted


def test_zero_window_turns_reservations_off() -> None:
    reservations = HomeReservations(window_s=0.0, clock=Clock())
    reservations.arrived("acme", home="r0", chosen="r0")
    reservations.finished("acme", chosen="r0")
    assert reservations.reserved("r0") == 0 and reservations.standing("acme") == KeyStanding()


def test_a_held_reservation_is_taken_even_at_the_cap_and_busy_keys_count_reservations() -> None:
    ring = Ring(["r0", "r1", "r2"], vnodes=160)
    home, second, _ = ring.preference("acme")
    # Home: 2 in flight + 1 reserved, at the cap ceil(1.25 * (3 + 1) / 3) = 2 on in flight alone.
    loads = [ReplicaLoad(r, True, 2 if r == home else 0, reserved=1 if r == home else 0) for r in ring.replica_ids]

    def decide_for(standing: KeyStanding) -> RoutingDecision:
        return decide(
            ring.preference("acme"),
            "acme",
            loads,
            pool="p",
            policy="bounded_consistent_hash",
            balance_factor=1.25,
            standing=standing,
        )

    taken = decide_for(KeyStanding(0, holds_reservation=True))
    assert (taken.chosen, taken.used_reservation, taken.reasons) == (home, True, ["home"])
    busy = decide_for(KeyStanding(in_flight=3))
    assert busy.capacity == 2 and busy.chosen == second and busy.reasons[0] == "spill:over_capacity"


def test_a_key_with_nothing_in_flight_is_not_bound_by_reservations() -> None:
    ring = Ring(["r0", "r1", "r2"], vnodes=160)
    home = ring.home("newcomer")
    # An idle fleet where another key reserved the newcomer's home: the cap is ceil(1.25 * 2 / 3) = 1.
    loads = [ReplicaLoad(r, True, 0, reserved=1 if r == home else 0) for r in ring.replica_ids]
    decision = decide(
        ring.preference("newcomer"), "newcomer", loads, pool="p", policy="bounded_consistent_hash", balance_factor=1.25
    )
    assert decision.chosen == home and not decision.used_reservation


class _Pool:
    """The gateway's Pool bookkeeping without its I/O: decide, then count the placement."""

    def __init__(self, n: int, factor: float) -> None:
        self.ids = [f"r{i}" for i in range(n)]
        self.ring = Ring(self.ids, vnodes=40)
        self.factor = factor
        self.clock = Clock()
        self.reservations = HomeReservations(window_s=5.0, clock=self.clock)
        self.in_flight = dict.fromkeys(self.ids, 0)

    def effective(self, replica_id: str) -> int:
        return self.in_flight[replica_id] + self.reservations.reserved(replica_id)

    def place(self, key: str) -> tuple[RoutingDecision, int, bool]:
        """The decision, the cap it was taken under, and whether reservations bound the key (it was busy)."""
        self.reservations.expire()
        busy = self.reservations.standing(key).in_flight > 0
        snapshot = [ReplicaLoad(r, True, self.in_flight[r], self.reservations.reserved(r)) for r in self.ids]
        cap = math.ceil(self.factor * (sum(self.effective(r) for r in self.ids) + 1) / len(self.ids))
        decision = decide(
            self.ring.preference(key),
            key,
            snapshot,
            pool="p",
            policy="bounded_consistent_hash",
            balance_factor=self.factor,
            standing=self.reservations.standing(key),
        )
        assert decision.chosen is not None
        self.in_flight[decision.chosen] += 1
        self.reservations.arrived(key, decision.home, decision.chosen)
        return decision, cap, busy


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=6),
    factor=st.sampled_from([1.0, 1.25, 1.5, 2.0]),
    events=st.lists(st.tuples(st.booleans(), st.integers(0, 20), st.floats(0, 3)), min_size=1, max_size=300),
)
def test_bounded_loads_over_in_flight_plus_reserved(
    n: int, factor: float, events: list[tuple[bool, int, float]]
) -> None:
    """A placement that did not take its own reservation went where the load was under the cap: in flight +
    reserved for a key with requests in flight, in flight for one without."""
    pool = _Pool(n, factor)
    running: list[RoutingDecision] = []
    for arrival, index, elapsed in events:
        pool.clock.advance(elapsed)
        pool.reservations.expire()  # place() expires lapsed keys first; measure after that
        if arrival:
            before = {r: pool.effective(r) for r in pool.ids}
            in_flight_before = dict(pool.in_flight)
            decision, cap, busy = pool.place(f"k{index}")
            assert decision.chosen is not None
            if decision.used_reservation:
                assert decision.chosen == decision.home
                assert pool.effective(decision.chosen) == before[decision.chosen]  # taking it changes no load
            else:
                assert (before if busy else in_flight_before)[decision.chosen] < cap
            running.append(decision)
        elif running:
            done = running.pop(index % len(running))
            assert done.chosen is not None
            pool.in_flight[done.chosen] -= 1
            pool.reservations.finished(done.key, done.chosen)
        assert all(pool.reservations.reserved(r) >= 0 for r in pool.ids)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=6),
    hot_concurrency=st.integers(min_value=1, max_value=40),
    events=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1000)), min_size=1, max_size=400),
)
def test_a_light_key_stays_home_whatever_a_hot_key_does(
    n: int, hot_concurrency: int, events: list[tuple[int, int]]
) -> None:
    """Light keys (one request at a time, active) go home on every request after their first, in any interleaving
    with a hot key that keeps up to ``hot_concurrency`` requests in flight."""
    pool = _Pool(n, 1.25)
    lights = [f"light-{i}" for i in range(7)]
    light_running: dict[str, RoutingDecision] = {}
    hot_running: list[RoutingDecision] = []
    for light in lights:  # each light key's first request, before the hot one turns up
        decision, _, _ = pool.place(light)
        pool.in_flight[decision.chosen or ""] -= 1
        pool.reservations.finished(light, decision.chosen or "")
    for actor, pick in events:
        pool.clock.advance(0.01)
        if actor == 7:  # the hot key: add a request, or finish one when at its concurrency
            if len(hot_running) < hot_concurrency:
                hot_running.append(pool.place("hot")[0])
            else:
                done = hot_running.pop(pick % len(hot_running))
                pool.in_flight[done.chosen or ""] -= 1
                pool.reservations.finished("hot", done.chosen or "")
            continue
        light = lights[actor]
        if light in light_running:
            done = light_running.pop(light)
            pool.in_flight[done.chosen or ""] -= 1
            pool.reservations.finished(light, done.chosen or "")
        else:
            decision, _, _ = pool.place(light)
            assert decision.chosen == decision.home, (light, decision)
            light_running[light] = decision
