"""Home reservations: the bookkeeping, and the decisions bounded loads take with them. Their properties over any
interleaving are tested on the real pool (tests/gateway/fleet/test_pool_properties.py)."""

from __future__ import annotations

from gateway.routing.decision import KeyStanding, ReplicaLoad, RoutingDecision
from gateway.routing.pipeline import decide
from gateway.routing.reservations import HomeReservations, Reservation
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


def test_a_state_handed_in_keeps_the_keys_reservation_and_lapses_in_the_order_of_activity() -> None:
    """A caller's object (the pool's entry for the key) holds the key's state where it has none here; a key that
    already has one keeps it; reservations lapse by last activity whichever object holds them."""
    clock = Clock()
    reservations = HomeReservations(window_s=2.0, clock=clock)
    mine, other = Reservation(), Reservation()
    reservations.arrived("acme", home="r0", chosen="r1", fresh=mine)
    assert (mine.home, mine.in_flight, mine.in_flight_at_home) == ("r0", 1, 0) and reservations.reserved("r0") == 1
    reservations.arrived("acme", home="r0", chosen="r0", fresh=other)  # acme has its state: ``other`` is not used
    assert (mine.in_flight, mine.in_flight_at_home) == (2, 1) and not hasattr(other, "home")
    assert reservations.reserved("r0") == 0
    reservations.arrived("beta", home="r1", chosen="r1")  # none handed in: one made here
    reservations.finished("acme", chosen="r1")
    reservations.finished("acme", chosen="r0")  # acme's last activity is after beta's
    reservations.finished("beta", chosen="r1")
    clock.advance(1.0)
    reservations.arrived("acme", home="r0", chosen="r0")
    reservations.finished("acme", chosen="r0")
    clock.advance(1.5)  # beta idle 2.5 s, acme 1.5 s
    reservations.expire()
    assert reservations.standing("beta") == KeyStanding() and reservations.standing("acme").holds_reservation
    assert reservations.reserved("r1") == 0 and reservations.reserved("r0") == 1
