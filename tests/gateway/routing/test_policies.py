from __future__ import annotations

import pytest

from gateway.routing.decision import ReplicaLoad
from gateway.routing.pipeline import decide
from gateway.routing.ring import Ring

RING = Ring(["r0", "r1", "r2"], vnodes=160)
KEY = "acme"
ORDER = RING.preference(KEY)
HOME, SECOND, THIRD = ORDER


def replicas(home: int = 0, second: int = 0, third: int = 0, down: tuple[str, ...] = ()) -> list[ReplicaLoad]:
    load = {HOME: home, SECOND: second, THIRD: third}
    return [ReplicaLoad(r, r not in down, load[r]) for r in ("r0", "r1", "r2")]


@pytest.mark.parametrize(
    ("policy", "fleet", "chosen", "reasons"),
    [
        pytest.param("bounded_consistent_hash", replicas(), HOME, ["home"], id="bounded-idle-home"),
        # total 4+1 over 3, cap ceil(1.25*5/3)=3: home at 4 is over, second at 0 takes it
        pytest.param(
            "bounded_consistent_hash",
            replicas(home=4),
            SECOND,
            ["spill:over_capacity", "spill:ring"],
            id="bounded-spill",
        ),
        # cap ceil(1.25*7/3)=3: home 3 and second 3 are full, third takes it
        pytest.param(
            "bounded_consistent_hash",
            replicas(3, 3, 0),
            THIRD,
            ["spill:over_capacity", "spill:ring"],
            id="bounded-walk",
        ),
        pytest.param(
            "bounded_consistent_hash", replicas(down=(HOME,)), SECOND, ["spill:unhealthy", "spill:ring"], id="home-down"
        ),
        pytest.param("consistent_hash", replicas(home=50), HOME, ["home"], id="unbounded-stays-home"),
        pytest.param("least_loaded", replicas(2, 1, 0), THIRD, ["policy:least_loaded"], id="least-loaded"),
    ],
)
def test_decisions(policy: str, fleet: list[ReplicaLoad], chosen: str, reasons: list[str]) -> None:
    decision = decide(RING.preference(KEY), KEY, fleet, pool="p", policy=policy, balance_factor=1.25)
    assert decision.home == HOME
    assert decision.chosen == chosen
    assert decision.reasons == reasons


@pytest.mark.parametrize(
    ("fleet", "floor", "chosen", "capacity"),
    [
        pytest.param(replicas(home=4), 8, HOME, 8, id="under-the-floor-stays-home"),  # plain cap 3
        pytest.param(replicas(home=8), 8, SECOND, 8, id="at-the-floor-spills"),
        pytest.param(replicas(home=20, second=20), 8, THIRD, 18, id="the-bound-rules-above-the-floor"),  # 41/3 x 1.25
    ],
)
def test_the_capacity_never_falls_below_the_floor(
    fleet: list[ReplicaLoad], floor: int, chosen: str, capacity: int
) -> None:
    decision = decide(
        RING.preference(KEY),
        KEY,
        fleet,
        pool="p",
        policy="bounded_consistent_hash",
        balance_factor=1.25,
        capacity_floor=floor,
    )
    assert (decision.chosen, decision.capacity) == (chosen, capacity)


def test_no_healthy_replica() -> None:
    decision = decide(
        RING.preference(KEY),
        KEY,
        replicas(down=("r0", "r1", "r2")),
        pool="p",
        policy="consistent_hash",
        balance_factor=1,
    )
    assert decision.chosen is None
    assert decision.reasons == ["no_healthy_replica"]


def test_round_robin_cycles_through_healthy_replicas() -> None:
    picks = [
        decide(RING.preference(KEY), KEY, replicas(), pool="p", policy="round_robin", balance_factor=1, tick=t).chosen
        for t in range(6)
    ]
    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2"]


@pytest.mark.parametrize(
    ("fleet", "resident", "chosen", "reasons"),
    [
        # home over the cap: the resident third replica beats the second on the ring
        pytest.param(replicas(home=4), {THIRD}, THIRD, ["spill:over_capacity", "spill:resident"], id="spill-resident"),
        # the replica holding it is full too: ring order
        pytest.param(replicas(4, 0, 4), {THIRD}, SECOND, ["spill:over_capacity", "spill:ring"], id="resident-full"),
        # residency never pulls a request off a home that has room
        pytest.param(replicas(), {SECOND}, HOME, ["home"], id="home-wins"),
        pytest.param(replicas(down=(HOME,)), {THIRD}, THIRD, ["spill:unhealthy", "spill:resident"], id="down-resident"),
    ],
)
def test_a_spill_prefers_a_replica_where_the_adapter_is_resident(
    fleet: list[ReplicaLoad], resident: set[str], chosen: str, reasons: list[str]
) -> None:
    decision = decide(
        RING.preference(KEY),
        KEY,
        fleet,
        pool="p",
        policy="bounded_consistent_hash",
        balance_factor=1.25,
        resident=frozenset(resident),
    )
    assert (decision.chosen, decision.reasons) == (chosen, reasons)


def test_a_replica_in_slow_start_takes_a_share_of_the_capacity() -> None:
    # Loads home 1, second 1, third 1: cap ceil(1.25 * 4 / 3) = 2; home at weight 0.4 may hold ceil(0.8) = 1.
    loads = [ReplicaLoad(r, True, 1, weight=0.4 if r == HOME else 1.0) for r in ("r0", "r1", "r2")]
    decision = decide(RING.preference(KEY), KEY, loads, pool="p", policy="bounded_consistent_hash", balance_factor=1.25)
    assert decision.chosen == SECOND and decision.reasons[0] == "spill:over_capacity"
    everyone_slow = [ReplicaLoad(r, True, 1, weight=0.1) for r in ("r0", "r1", "r2")]
    decision = decide(
        RING.preference(KEY), KEY, everyone_slow, pool="p", policy="bounded_consistent_hash", balance_factor=1.25
    )
    assert decision.chosen == HOME  # all in slow start: the plain bound decides


@pytest.mark.parametrize(
    ("fleet", "avoid", "chosen", "reasons", "excluded"),
    [
        pytest.param(
            replicas(down=(HOME,)), (), SECOND, ["spill:unhealthy", "spill:ring"], {HOME: "unhealthy"}, id="home-down"
        ),
        pytest.param(replicas(), (HOME,), SECOND, ["spill:retry", "spill:ring"], {HOME: "retry"}, id="retry-elsewhere"),
        pytest.param(
            [ReplicaLoad(r, True, 0, at_cap=r == HOME) for r in ("r0", "r1", "r2")],
            (),
            SECOND,
            ["spill:replica_cap", "spill:ring"],
            {HOME: "replica_cap"},
            id="home-at-its-cap",
        ),
        # cap ceil(1.25*5/3)=3: the home at 4 is over the bound, and the decision says so
        pytest.param(
            replicas(home=4), (), SECOND, ["spill:over_capacity", "spill:ring"], {HOME: "over_capacity"}, id="bound"
        ),
    ],
)
def test_a_decision_names_every_replica_it_left_out_and_why(
    fleet: list[ReplicaLoad], avoid: tuple[str, ...], chosen: str, reasons: list[str], excluded: dict[str, str]
) -> None:
    decision = decide(
        RING.preference(KEY), KEY, fleet, pool="p", policy="bounded_consistent_hash", balance_factor=1.25, avoid=avoid
    )
    assert (decision.chosen, decision.reasons, decision.excluded, decision.unavailable) == (
        chosen,
        reasons,
        excluded,
        None,
    )


@pytest.mark.parametrize(
    ("fleet", "avoid", "unavailable", "reason"),
    [
        pytest.param(replicas(down=("r0", "r1", "r2")), (), "down", "no_healthy_replica", id="all-down"),
        pytest.param(replicas(down=(HOME, SECOND)), (THIRD,), "down", "no_healthy_replica", id="retry-had-nowhere"),
        pytest.param(
            [ReplicaLoad(r, r != HOME, 9, at_cap=r != HOME) for r in ("r0", "r1", "r2")],
            (),
            "full",
            "no_replica_with_room",
            id="up-ones-at-cap",
        ),
    ],
)
def test_no_replica_says_whether_the_pool_is_down_or_full(
    fleet: list[ReplicaLoad], avoid: tuple[str, ...], unavailable: str, reason: str
) -> None:
    for policy in ("bounded_consistent_hash", "consistent_hash", "round_robin", "least_loaded"):
        decision = decide(RING.preference(KEY), KEY, fleet, pool="p", policy=policy, balance_factor=1.25, avoid=avoid)
        assert (decision.chosen, decision.unavailable, decision.reasons) == (None, unavailable, [reason])
