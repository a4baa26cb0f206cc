"""Spills kept on a key's planned replicas (``routing.home_placement: traffic``): which of a decision's candidates
a request may take, before the policy scores them.

The plan (gateway/placement/plan.py) gives every key a replica set within the pool's slot budget. Spills used to
add copies the plan never counted: a noisy tenant's requests, predicted faster elsewhere, put its adapter on every
replica within seconds and pushed out its quiet neighbours' (their cold loads in 20 s went from none to 24-26, 0-2
now: docs/benchmarks.md), and on the collide trace the heavy tenants' spills kept 18-19 copies in 16 slots, so some
light tenant always lacked one.
So a request goes to its key's planned replicas while one of them has fewer than ``queue`` requests in flight (the
load routing counts; ``queue`` 0: the pool's seats where stated, the requests a replica runs at once, so a spill
leaves only once every planned replica queues; else ``capacity_floor``). Past that a replica off the set may compete
too, where taking it pushes out no other key's planned adapter still in use: the adapter is already resident there
beside every adapter planned there, a slot is free, or the adapter a load there would push out (the engine's least
recently used idle one) is not planned there or no request used it for ``idle_s``. The pool then takes the off-set
replica only when predicted faster than the best planned one by ``margin_ms`` (Pool._decide_confined).

Where the pool states its seats, the rest of the off-set replicas compete too (``displace``): those where a load
pushes out a planned adapter in use. Without them a key whose planned replicas are over their seats queues there
without bound while every other slot holds a planned adapter in use: on the collide trace (16 adapters in 16 slots)
both heavy tenants, confined to the count-balanced home they shared until the plan's first split six seconds in,
queued 39 deep there while the other replicas ran 0-2 (TTFT p99 2.9-4.0 s against 0.65 s with balanced homes;
docs/benchmarks.md). Such a replica is taken only when predicted faster than the best planned one by ``margin_ms``
plus one adapter load (``PoolResidency.load_ms``): what the neighbour whose adapter it pushes out pays at its next
request. Where seats are not stated a queue cannot be told from a batch (a noisy tenant's 32 streams on replicas
that run 64 at once), and the bound stays as it was. A request
whose planned replicas are all down, avoided (a retry) or at their cap is not confined.

A key whose adapter already has a second home (planned, or warm where an earlier spill loaded it) takes no replica
off the set where its adapter is cold: the pool warms it there in the background and the request takes the best of
the rest (Pool._decide_confined; the hot trace's hot tenant waited for its third copy's load on the request path).
Once the adapter is resident on ``routing.spill_warm_replicas`` replicas nothing is warmed and it stays refused:
its spills make no copy more.

A key the plan left without a planned slot (``Pool.unplanned``: its slot paid for a heavy key's copy) goes to the
replicas of its order where its adapter is resident, or where a load pushes out no planned adapter in use
(``room_for``, as a spill above); where there is none it is not confined.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from gateway.config import PlacementConfig
from gateway.fleet.replica import Replica
from gateway.residency.lifecycle import PoolResidency
from gateway.routing.ring import Ring


@dataclass(frozen=True)
class PlanBound:
    queue: int  # requests in flight on every planned replica before a spill may leave the set (0: its seats)
    margin_ms: float  # how much faster an off-set replica must be predicted than the best planned one
    idle_s: float  # a planned adapter unused this long may be pushed out by an off-set spill

    @staticmethod
    def of(config: PlacementConfig) -> PlanBound | None:
        if not config.confine_spills:
            return None
        return PlanBound(config.off_plan_queue, config.off_plan_margin_ms, config.off_plan_idle_s)


class Pool(Protocol):
    """What the split reads of a pool (fleet/pool.py's Pool)."""

    ring: Ring
    replicas: dict[str, Replica]
    residency: PoolResidency
    max_in_flight_per_replica: int
    capacity_floor: int
    seats: int
    unplanned: frozenset[str]

    def routed_load(self, replica_id: str, now: float) -> int: ...


class Confined(NamedTuple):
    """A confined request's candidates: its planned replicas (in the set's order), the replicas off the set it may
    take too (empty until the queue bound is passed), and of those the ones where its load would push out a planned
    adapter in use (taken only by a wider margin: ``Pool._decide_confined``)."""

    inside: tuple[str, ...]
    outside: tuple[str, ...] = ()
    displace: frozenset[str] = frozenset()


def split(
    pool: Pool,
    bound: PlanBound,
    key: str,
    engine_model: str,
    order: tuple[str, ...],
    resident: frozenset[str],
    avoid: Collection[str],
) -> Confined | None:
    """The key's planned replicas a request may take (healthy, not avoided, under the per-replica cap), in the set's
    order, and the candidates off the set it may take too (empty until the queue bound is passed); None when the
    request is not confined (no planned replica it may take, or every candidate planned)."""
    replicas, cap = pool.replicas, pool.max_in_flight_per_replica
    if key in pool.unplanned:
        return _unplanned(pool, bound, engine_model, order, resident, avoid)
    planned = pool.ring.replica_set(key)
    inside = tuple(
        r
        for r in planned
        if (replica := replicas.get(r)) is not None and replica.healthy and r not in avoid and replica.in_flight < cap
    )
    if not inside or all(r in planned for r in order):
        return None
    now = time.monotonic()
    queue = bound.queue or pool.seats or pool.capacity_floor
    if any(pool.routed_load(r, now) < queue for r in inside):
        return Confined(inside)
    residency = pool.residency
    outside: list[str] = []
    displace: list[str] = []
    for r in order:
        if r in planned or r in avoid:
            continue
        if _spare(residency, r, engine_model) if r in resident else residency.room_for(r, bound.idle_s):
            outside.append(r)
        elif pool.seats > 0:
            outside.append(r)
            displace.append(r)
    return Confined(inside, tuple(outside), frozenset(displace))


def _unplanned(
    pool: Pool,
    bound: PlanBound,
    engine_model: str,
    order: tuple[str, ...],
    resident: frozenset[str],
    avoid: Collection[str],
) -> Confined | None:
    """An unplanned key's candidates: those of ``order`` (healthy, not avoided, under the cap) where its adapter is
    resident or a load takes a slot no planned adapter in use holds; None (not confined) where none is, or all."""
    replicas, cap, residency = pool.replicas, pool.max_in_flight_per_replica, pool.residency
    room = tuple(
        r
        for r in order
        if (replica := replicas.get(r)) is not None
        and replica.healthy
        and r not in avoid
        and replica.in_flight < cap
        and (r in resident or residency.room_for(r, bound.idle_s))
    )
    if not room or len(room) == len(order):
        return None
    return Confined(room)


def _spare(residency: PoolResidency, replica_id: str, engine_model: str) -> bool:
    """Whether a copy of the adapter on the replica leaves a slot for each adapter planned there: a copy in use
    where the planned adapters fill the slots keeps one of them out (collide: a heavy key moved by the plan kept
    using the copy at its old home, and the light keys planned there took turns in the slots left, a cold load
    each, on the request path)."""
    planned = residency.plan.get(replica_id, frozenset())
    return len(planned) - (engine_model in planned) < residency.max_adapters
