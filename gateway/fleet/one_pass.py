"""The common decision of the bounded policies in one pass over the pool's own records: every candidate up, at full
weight, under its per-replica cap, and (unless a reservation decides) under the bound, for a request's own decision
(not a retry, not an explanation) with linear scorers.

Then no filter leaves a replica out and the bound excludes none, so the general pipeline (the pool's snapshot of a
``ReplicaLoad`` per candidate, then routing/pipeline.py: filters, the picker's bound, its cold-load rule and its
score in routing/pickers.py) reduces to one loop over the candidates that reads each replica's record, checks it,
keeps the load total and the highest load, and scores it by the scorers' summed table as ``pickers.lowest_predicted``
does; then the picker's last step: ``bounded_consistent_hash`` keeps the home, ``predicted_ttft`` takes the lowest
predicted TTFT. Anything else (a replica down, in slow start, at its cap or over the bound) returns None and the
general pipeline decides. A property test on the real pool holds the two to the same decision
(tests/gateway/fleet/test_one_pass.py).

Why: a decision runs once per request and the target is 20 us at p99 for the whole of it. Building a snapshot tuple
per candidate and reading it back cost about 7,000 instructions a candidate (of 115,000 a decision at 8
candidates); reading the records in the loop that scores them costs about half.

A plain decision keeps no snapshot (``RoutingDecision.snapshot`` and ``kept`` are empty; ``order`` names the
candidates, every one kept) and its chosen replica's prediction only: ``Pool.explain`` takes the general pipeline
and keeps every candidate's figures.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from typing import Protocol

from gateway.fleet.keys import Entry, KeyEntry
from gateway.fleet.replica import Replica
from gateway.residency.lifecycle import PoolResidency, among_newest
from gateway.routing.costs import Regime, gpu_slot_waits, loads_ahead_ms
from gateway.routing.decision import NO_PARTS, Prediction, RoutingDecision, plain_decision
from gateway.routing.reservations import HomeReservations
from gateway.routing.scorers import Scoring


class Pool(Protocol):
    """What the one pass reads of a pool (fleet/pool.py's Pool), attributes only: one attribute read each."""

    name: str
    policy: str
    replicas: dict[str, Replica]
    residency: PoolResidency
    reservations: HomeReservations
    scoring: Scoring | None
    balance_factor: float
    capacity_floor: int
    max_in_flight_per_replica: int
    shared_load_view: bool
    engine_view_max_age_s: float | None
    scrape_fresh_s: float
    running_fresh_s: float
    prefix_warm_s: float


_NEVER = -math.inf
_NOWHERE: frozenset[str] = frozenset()
# A named tuple's own __new__ without its Python-level argument handling (every field is passed, in order).
_new = tuple.__new__


def decide_plain(
    pool: Pool,
    key: str,
    engine_model: str | None,
    order: tuple[str, ...],
    candidates: tuple[Entry, ...],
    homes: frozenset[str],
    resident: frozenset[str],
    entry: KeyEntry,
) -> RoutingDecision | None:
    """The decision when the case is plain (see the module docstring), else None. ``order``: the key's candidates,
    home first; ``candidates``: their entries (``Entry``); ``homes``: the key's replica set (its home and the
    rest: no affinity margin there); ``resident``: where the request's adapter is resident; ``entry``: the key's
    (gateway/fleet/keys.py), where it was served last."""
    if not order:
        return None
    scoring = pool.scoring
    if scoring is not None and scoring.table() is None:  # a scorer that is not linear: asked per candidate, generally
        return None
    # The key's standing (HomeReservations.standing, inline): its requests in flight, and whether it holds its home
    # reservation (an active key does while it has none in flight, or none at home).
    reservations = pool.reservations
    state = reservations.active.get(key)
    key_in_flight = 0 if state is None else state.in_flight
    holds_reservation = state is not None and (not key_in_flight or not state.in_flight_at_home)
    count_reserved = key_in_flight > 0
    reserved = reservations.by_replica
    cap = pool.max_in_flight_per_replica
    # One clock read for the whole decision: health's clock and the scrapes' are both time.monotonic here.
    now = time.monotonic()
    # The load routing counts (routing.load_view): this gateway's own, plus the other gateways' as they last shared
    # them, or the engine's last scrape plus this gateway's change since. ``own``: this gateway's count alone.
    elsewhere = pool.residency.signal.load_elsewhere(pool.name) if pool.shared_load_view else None
    max_age = pool.engine_view_max_age_s
    own = elsewhere is None and max_age is None
    total, most = 1, 0
    if scoring is None:  # bounded_consistent_hash: check and sum, no score
        for replica_id, replica, health, _ in candidates:
            if now < health.full_weight_at:
                healthy, weight = health.routing_state(now)
                if not healthy or weight < 1.0:
                    return None
            in_flight = replica.in_flight
            if in_flight >= cap:
                return None
            if own:
                load = in_flight
            elif elsewhere is not None:
                load = in_flight + elsewhere.get(replica_id, 0)
            else:
                load = replica.load_view(now, max_age)
            held = reserved[replica_id]
            total += load + held
            if count_reserved:
                load += held
            if load > most:
                most = load
        capacity = math.ceil(pool.balance_factor * total / len(order))
        if capacity < pool.capacity_floor:
            capacity = pool.capacity_floor
        if most >= capacity and not holds_reservation:  # a reservation takes home whatever the bound says
            return None
        home = order[0]
        return plain_decision(
            pool.name, pool.policy, key, home, home, "home", capacity, holds_reservation, {}, resident, None,
            False, order,
        )  # fmt: skip
    home = order[0]
    # Where the key was served within prefix_warm_s (its prefix likely still in the KV cache): read only where the
    # adapter is on the GPU, the one regime split it decides.
    served_by, served_at, served_more = entry.served_by, entry.served_at, entry.served_more
    warm_since = now - pool.prefix_warm_s
    # Where other gateways have requests in flight with the adapter (their loads under way included).
    flying: Collection[str] = ()
    if engine_model is not None:
        flying = pool.residency.signal.flying_on(pool.name, engine_model)
    listed_after = now - pool.scrape_fresh_s  # a scrape since then still lists the adapters running
    # Each regime's row (Scoring.table's, as one plain tuple) as locals: per candidate, local reads instead of
    # attribute reads.
    (
        warm_c, warm_p, warm_o, _, warm_s, kv_cold_c, kv_cold_p, kv_cold_o, _, kv_cold_s,
        host_c, host_p, host_o, _, host_s, cold_c, cold_p, cold_o, cold_a, cold_s,
    ) = scoring.rows  # fmt: skip
    # The gpu_slot term (when on): the expected wait for a GPU adapter slot where the adapter would wait for one
    # (Pool._gpu_slot_ms, inline).
    slot_waits = engine_model is not None and bool(warm_s or kv_cold_s or host_s or cold_s)
    running_after = now - pool.running_fresh_s
    gpu_slot_ms = scoring.model.gpu_slot_ms
    signal = pool.residency.signal
    # The adapter loads under way per replica, this gateway's and the others' (read only by a cold candidate, and
    # only when the load_ahead scorer is on and some load is under way).
    loading_here = loading_there = None
    if cold_a:
        residency = pool.residency
        loading_here, loading_there = residency.loading_here, residency.signal.loading_elsewhere(pool.name)
        if not loading_here and not loading_there:
            cold_a = 0.0
    best_id, best_ms, best_load, best_slot = home, math.inf, 0, False
    # The best candidate where the adapter is cold, kept apart.
    cold_id, cold_ms, cold_load, cold_slot = home, math.inf, 0, False
    warm_count = warm_load = 0
    regime: Regime
    best_regime: Regime = "cold"
    for replica_id, replica, health, view in candidates:
        if now < health.full_weight_at:
            healthy, weight = health.routing_state(now)
            if not healthy or weight < 1.0:
                return None
        in_flight = replica.in_flight
        if in_flight >= cap:
            return None
        if own:
            load = in_flight
        elif elsewhere is not None:
            load = in_flight + elsewhere.get(replica_id, 0)
        else:
            load = replica.load_view(now, max_age)
        held = reserved[replica_id]
        total += load + held
        judged = load + held if count_reserved else load
        if judged > most:
            most = judged
        # The adapter on the GPU there (Pool.snapshot says why each test is asked where it is), then the regime.
        # The base model is on every GPU; an adapter is where the engine's fresh scrape lists it running, else the
        # residency record is asked (where it can say yes): PoolResidency.likely_on_gpu, inline.
        if engine_model is None or (
            (scraped := replica.engine_load) is not None
            and engine_model in scraped.running_adapters
            and replica.scraped_at >= listed_after
        ):
            on_gpu = True
        elif in_flight or replica_id in resident or replica_id in flying:
            if engine_model in view.in_flight:
                on_gpu = True
            else:
                held_here = view.resident
                used = held_here.get(engine_model)
                if used is None:
                    on_gpu = replica_id in flying
                else:
                    slots = 1 if scraped is None else scraped.gpu_slots or 1
                    # among_newest's first test inline: a set that fits the GPU's slots is on it whole.
                    on_gpu = len(held_here) <= slots or among_newest(held_here, used, slots) or replica_id in flying
        else:
            on_gpu = False
        slot_ms = 0.0
        if slot_waits:
            assert engine_model is not None
            scraped = replica.engine_load
            if scraped is not None and scraped.gpu_slots:
                running = scraped.running_adapters if replica.scraped_at >= running_after else _NOWHERE
                there_now = signal.adapters_elsewhere(pool.name, replica_id)
                if gpu_slot_waits(engine_model, view.in_flight, there_now, running, scraped.gpu_slots):
                    slot_ms = gpu_slot_ms
        if on_gpu:
            if (replica_id == served_by and served_at >= warm_since) or (
                served_more is not None and served_more.get(replica_id, _NEVER) >= warm_since
            ):
                regime = "warm"
                constant, per_request, off_home_ms, per_slot = warm_c, warm_p, warm_o, warm_s
            else:
                regime = "kv_cold"
                constant, per_request, off_home_ms, per_slot = kv_cold_c, kv_cold_p, kv_cold_o, kv_cold_s
        elif replica_id in resident:
            regime = "host"
            constant, per_request, off_home_ms, per_slot = host_c, host_p, host_o, host_s
        else:
            ms = cold_c + cold_p * load
            if slot_ms:  # the term is 0 without a wait: no float arithmetic for it (most candidates)
                ms += cold_s * slot_ms
            if cold_a:
                assert loading_here is not None and loading_there is not None
                here, there = loading_here.get(replica_id), loading_there.get(replica_id)
                if here is not None or there is not None:
                    ms += cold_a * loads_ahead_ms(here, there, now, pool.residency.load_ms)
            if replica_id not in homes:
                ms += cold_o
            if ms < cold_ms:  # strictly: a tie keeps the earlier candidate in the key's ring order
                cold_id, cold_ms, cold_load, cold_slot = replica_id, ms, load, slot_ms > 0
            continue
        warm_count += 1
        warm_load += load
        ms = constant + per_request * load
        if slot_ms:
            ms += per_slot * slot_ms
        if replica_id not in homes:
            ms += off_home_ms
        if ms < best_ms:
            best_id, best_ms, best_load, best_regime, best_slot = replica_id, ms, load, regime, slot_ms > 0
    capacity = math.ceil(pool.balance_factor * total / len(order))
    if capacity < pool.capacity_floor:
        capacity = pool.capacity_floor
    if most >= capacity:
        return None
    # The best where the adapter is warm against the best where it is cold (pickers.warm_or_cold, inline): the cold
    # one wins when predicted faster by more than the cold margin, which is routing.cold_margin_ms for a hot key
    # and 0 for another; within the margin the adapter is warmed there ahead.
    ahead, due = None, False
    if not warm_count:
        best_id, best_ms, best_load, best_regime, best_slot = cold_id, cold_ms, cold_load, "cold", cold_slot
    else:
        margin = scoring.cold_margin_ms
        hold = warm_count >= 2 and scoring.hold_copies
        if margin and (key_in_flight < pool.capacity_floor * warm_count or 3 * key_in_flight < 2 * warm_load):
            margin = 0.0  # not a hot key
        if hold:  # a key with two copies or more takes no cold replica: pickers.warm_or_cold
            if cold_ms < best_ms + margin:
                ahead, due = cold_id, cold_ms < best_ms
        elif cold_ms + margin < best_ms:
            best_id, best_ms, best_load, best_regime, best_slot = cold_id, cold_ms, cold_load, "cold", cold_slot
        elif margin and cold_ms < best_ms + margin:
            # Due once the cold replica is predicted faster outright (warm_or_cold): warmed whatever it pushes out.
            ahead, due = cold_id, cold_ms < best_ms
    # The chosen replica's prediction only.
    prediction = _new(Prediction, (best_regime, best_load, NO_PARTS, best_ms, best_slot))
    return plain_decision(
        pool.name, pool.policy, key, home, best_id, "home" if best_id == home else "spill:faster", capacity, False,
        {best_id: prediction}, resident, ahead, due, order,
    )  # fmt: skip
