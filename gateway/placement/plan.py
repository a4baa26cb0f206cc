"""Homes from traffic: one pool's plan for an interval, from the fleet's measured load per key and the homes in force.

Each key has a replica set, its home first. A key's expected load (requests per second) is shared evenly by its
set's replicas. One interval changes at most ``max_moves`` keys, in this order:

1. pins: a pinned key's set is its pinned replica alone;
2. evacuations: a replica that left the plan (drained, or gone from discovery) is replaced in every set that holds
   it, by the replica with the least expected load, heaviest key first;
3. replica sets, within the slot budget (``slots`` x replicas: every key keeps one copy, its home, and the copies
   beyond one per key share what is left): first a key whose copies overfill a replica's ``slots``, or the pool's
   budget, gives its last copy back (the lightest copy first; a table planned before the budget, or a replica gone);
   then a key left without a planned slot (below) gets one back where one is free, heaviest first; then a key whose
   load per replica exceeds ``grow_above`` x the pool's mean load per replica, or more than ``spill_share`` of whose
   requests the scheduler sent off its set for demand (its homes over the bound, or another replica predicted
   faster), gains the least loaded replica it lacks whose planned adapters leave a slot free, or none (a copy where
   the planned adapters fill the slots pushes another key's adapter out, and that key's requests then pay cold loads:
   how a noisy tenant took its quiet neighbours' slots); each by more than the noise (and with at least
   ``replicate_min_rps``), up to ``max_replicas_per_key``. A key sized by seats grows even where the planned adapters
   fill every slot: where its own requests in flight (its requests per second times the seconds each held a seat) per
   replica of its set exceed ``seat_share`` of ``seats`` (what one replica runs at once, the pool's ``seats``: one key
   taking more than that share queues at its bursts, and its neighbours behind it, which no share of the rate shows:
   collide's heavy tenants are 1.2x the mean rate each; a noisy tenant whose replica runs its streams at once is not
   sized by seats). It gains the least loaded replica where a key planned alone is lighter than the share the copy takes
   and than ``unplan_below_rps`` (a key whose requests come further apart than a planned slot protects), by more than
   the noise: the lightest such key there pays for the slot. A key overloaded (its requests in flight per replica past
   every seat of a replica: its queue there grows without bound) is paid for by the lightest key planned alone anywhere
   that is lighter than the copy's share, whatever ``unplan_below_rps`` says: a payer's reloads cost about a cold load
   per request it sends, bounded, and the queue is not. Any key pays only while the copies the growing key may have
   serve its demand (its requests in flight within every seat of ``max_replicas_per_key`` replicas): one whose demand
   passes those queues on its set whatever its neighbours pay, and one tenant's traffic shape (long generations) cost
   the lightest planned key its slot at every interval up to that many copies, for as long as it kept that shape; it
   grows into free slots only; so does, for ``repay_after_s``, a key that gave a copy back as its demand fell (a
   tenant bursting past ``shrink_after_s`` apart had its copy given back in each lull and paid for again at each
   burst: 29 neighbours' slots an hour at 60 s on, 70 s off; ``Plan.cooled_at``). The key that pays is
   *unplanned* (``Plan.unplanned``): it keeps its set for routing, but no slot is planned for its adapter (the fill
   does not load it; a request loads it where that pushes out no planned adapter in use, gateway/fleet/plan_bound.py).
   A set that would stay below ``shrink_below`` x that mean with one replica fewer (its own requests in flight per
   replica then below ``shrink_below`` x ``seat_share`` x ``seats``), and spills less than half that share, loses its
   last after ``shrink_after_s`` (hysteresis: the thresholds differ and shrinking waits);
4. balance: the most loaded replica gives a key away, to the replica whose pair then has the lowest peak (a plain
   move where that replica holds fewer than ``ceil(adapters / replicas)`` adapters, else a swap with its lightest
   key, which keeps adapter counts even: heavy keys spread, light keys pack where their adapters fit). A move is
   made only when it lowers the source's load by more than ``min_gain`` (a share) and by more than the noise of
   the measured load (``sigmas`` standard deviations of a moving average over ``window_s``); the balancing stops
   at the first move that does not: keys stay put unless moving them pays.

Keys being warmed at a new home (make before break, gateway/placement/placer.py) and pinned keys are not moved
again. Keys without a measured rate keep the ring's (balanced) home and count one adapter there. Pure: no I/O,
no clock but the one given; cheap enough to run every interval for thousands of keys (loadtests/bench_placement.py
measures it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

# A replica set, its home first.
Homes = tuple[str, ...]


@dataclass(frozen=True)
class PlanSettings:
    max_moves: int = 4
    min_gain: float = 0.1
    grow_above: float = 1.25
    shrink_below: float = 0.75
    shrink_after_s: float = 60.0
    replicate_min_rps: float = 1.0
    max_replicas_per_key: int = 3
    # The measured rates are moving averages of Poisson counts over ``window_s`` (traffic.window_s): a rate r is
    # known to about sqrt(r / (2 window_s)). A move or a growth must clear its threshold by ``sigmas`` of that, so
    # noise in a short window does not move keys back and forth (each move costs a cold load).
    window_s: float = 60.0
    sigmas: float = 3.0
    # A key also gains a replica while more than this share of its requests leave its set for demand (the scheduler
    # found its homes over the bound, or another replica faster), and loses one only below half that share.
    spill_share: float = 0.2
    # A key is sized by seats while its requests in flight per replica of its set exceed this share of a replica's
    # seats; a key pays for its copy (unplanned) only below ``unplan_below_rps`` requests per second: one whose
    # requests come further apart than placement.off_plan_idle_s, whose planned adapter a spill may push out anyway.
    # A busier payer costs about a cold load per request it sends, its adapter pushed out by its neighbours' and
    # theirs by it (collide's light tenants at 0.7 req/s: 54-55 cold loads in 30 s against 8-25).
    seat_share: float = 0.5
    unplan_below_rps: float = 0.2
    # A key that gave a copy back as its demand fell (cooled) makes no neighbour pay for a copy again for this long:
    # it grows into free slots only. A tenant bursting 60 s on and 70 s off took a neighbour's slot at each burst, its
    # copies given back shrink_after_s into each lull (29 slots an hour, 0-2 with this; tests/gateway/placement).
    repay_after_s: float = 1800.0

    def noise(self, rate: float) -> float:
        """``sigmas`` standard deviations of a measured rate of ``rate`` requests per second."""
        return self.sigmas * math.sqrt(max(rate, 0.0) / (2 * self.window_s))


@dataclass(frozen=True)
class Change:
    """One key's set changed this interval, and why (for the status page and /admin/route)."""

    key: str
    before: Homes
    after: Homes
    why: str


@dataclass(frozen=True)
class PlanInput:
    replicas: Sequence[str]  # the replicas that take part (not drained), in a stable order
    loads: Mapping[str, float]  # measured requests per second by key (the busiest keys)
    current: Mapping[str, Homes]  # the sets in force (keys without one have their ring home)
    ring_home: Callable[[str], str]  # the ring's (balanced) home of a key without a set
    known: Collection[str] = ()  # keys the gateway knows without traffic (tenants): they count one adapter each
    pinned: Mapping[str, str] = field(default_factory=dict)
    # Of the measured requests per second, those the scheduler sent off the key's set for demand.
    spills: Mapping[str, float] = field(default_factory=dict)
    frozen_keys: Collection[str] = ()  # keys not to move this interval (being warmed)
    below_since: Mapping[str, float] = field(default_factory=dict)  # when a key's set first could shrink
    now: float = 0.0
    # Adapters each replica holds at most (the pool's max_adapters; 0: not bounded): a copy where the planned
    # adapters already fill a replica's slots pushes another key's adapter out.
    slots: int = 0
    # Requests in flight on average by key (traffic's in_flight), and what one replica runs at once (the pool's
    # seats; 0: not stated, no key is sized by seats).
    in_flight: Mapping[str, float] = field(default_factory=dict)
    seats: float = 0.0
    # Keys the plan in force left without a planned slot (routed by their set, their adapter loaded on demand).
    unplanned: Collection[str] = ()
    # When each key last gave a copy back as its demand fell (cooled): none pays for its copies until repay_after_s on.
    cooled_at: Mapping[str, float] = field(default_factory=dict)


@dataclass
class Plan:
    homes: dict[str, Homes]  # every key whose set is not its ring home alone
    changes: list[Change]
    below_since: dict[str, float]
    load: dict[str, float]  # expected requests per second per replica after the plan (planned keys')
    adapters: dict[str, int]  # planned keys (adapters) per replica after the plan
    # Keys without a planned slot: each paid for a heavy key's copy sized by seats (their sets still route them).
    unplanned: set[str] = field(default_factory=set)
    # When a key last gave a copy back as its demand fell, for the keys within repay_after_s of it.
    cooled_at: dict[str, float] = field(default_factory=dict)


def plan(given: PlanInput, settings: PlanSettings) -> Plan:
    replicas = list(given.replicas)
    present = set(replicas)
    homes: dict[str, Homes] = {}
    for key in {*given.loads, *given.current, *given.known}:
        current = given.current.get(key)
        homes[key] = current if current else (given.ring_home(key),)
    below_since = {k: t for k, t in given.below_since.items() if k in homes}
    unplanned = {k for k in given.unplanned if k in homes and k not in given.pinned}
    # Kept while they bar a payer (a key that left the table keeps its entry too: back within the time, it is barred).
    cooled_at = {k: t for k, t in given.cooled_at.items() if given.now - t < settings.repay_after_s}
    if not replicas:
        return Plan(_kept(homes, given), [], below_since, {}, {}, unplanned, cooled_at)
    changes: list[Change] = []
    budget = settings.max_moves
    loads = given.loads
    fixed = set(given.frozen_keys)

    def change(key: str, after: Homes, why: str) -> None:
        nonlocal budget
        changes.append(Change(key, homes[key], after, why))
        homes[key] = after
        budget -= 1

    # 1. pins (each key changes once per interval at most: a changed key joins ``fixed``)
    for key, replica_id in sorted(given.pinned.items()):
        if budget <= 0:
            break
        if replica_id in present and homes.get(key) != (replica_id,):
            homes.setdefault(key, (given.ring_home(key),))
            change(key, (replica_id,), f"pinned to {replica_id}")
    fixed.update(key for key, replica_id in given.pinned.items() if replica_id in present)  # else evacuated below
    # 2. evacuations, heaviest first
    for key in sorted(homes, key=lambda k: (-loads.get(k, 0.0), k)):
        if budget <= 0:
            break
        if key in fixed or all(r in present for r in homes[key]):
            continue
        load, adapters = _tally(homes, loads, replicas, unplanned)
        kept = [r for r in homes[key] if r in present]
        # The least loaded replica, and among equals the one with the fewest adapters: keys without traffic (load 0)
        # all went to the first replica by name, past its slots.
        replaced = tuple(kept) or (min(replicas, key=lambda r: (load[r], adapters[r], r)),)
        gone = ", ".join(r for r in homes[key] if r not in present)
        change(key, replaced, f"left {gone}")
        fixed.add(key)
    # 3. the slot budget: copies beyond it are taken back first (a table planned before it, or replicas gone), then
    # replica sets grow and shrink with demand, within it
    budget_slots = given.slots * len(replicas)
    for key in _over_budget(homes, loads, replicas, given.slots, fixed, unplanned):
        members = homes[key]
        change(key, members[:-1], f"slot budget: {len(members)} copies of {key} leave another key without a slot")
        budget += 1  # taking a copy back keeps the budget's promise; it is not a move the bound counts
        fixed.add(key)
    for key in sorted(unplanned - fixed, key=lambda k: (-loads.get(k, 0.0), k)):  # a slot free again: planned again
        load, adapters = _tally(homes, loads, replicas, unplanned)
        room = [r for r in replicas if not given.slots or adapters[r] < given.slots]
        if not room or (budget_slots and sum(adapters.values()) >= budget_slots):
            break
        home = homes[key][0]
        target = home if home in room else min(room, key=lambda r: (load[r], adapters[r], r))
        unplanned.discard(key)
        change(key, (target,), f"planned again: a slot is free on {target}")
        budget += 1  # as the budget's take-back: it keeps a promise, not a move the bound counts
        fixed.add(key)
    total = sum(loads.get(k, 0.0) for k in homes if k not in unplanned)
    mean = total / len(replicas)

    def payer_noise(rate: float) -> float:
        """A payer's noise: a rate read as zero is known no better than one request in the window (with no margin,
        a light key that happened to send nothing in a 4 s window paid for a heavy key's copy: collide, 38 cold
        loads in that run)."""
        return settings.noise(max(rate, 1 / (2 * settings.window_s)))

    seats = given.seats
    for key in sorted(homes, key=lambda k: (-loads.get(k, 0.0), k)):
        if budget <= 0:
            break
        if key in fixed or key in unplanned:
            continue
        rate, members = loads.get(key, 0.0), homes[key]
        size = len(members)
        demand = given.in_flight.get(key, 0.0)
        # Its requests in flight per replica past what one replica takes of it (seat_share of its seats): queued.
        seated = seats > 0 and demand / size > settings.seat_share * seats
        # Past every seat of its replicas: its queue there grows without bound, whatever its neighbours pay.
        overloaded = seated and demand / size > seats
        limit = min(settings.max_replicas_per_key, len(replicas))
        # Another key pays for a copy only while the copies this key may have serve its demand (its requests in
        # flight within every seat of ``limit`` replicas). A key whose demand passes them (long generations: more
        # streams at once than a fleet gives one key) queues on its set whatever its neighbours pay; with payers it
        # cost the lightest planned key its warm slot at every interval up to max_replicas_per_key copies, each
        # unplanned for as long as its traffic kept that shape. It grows into free slots only.
        servable = demand <= limit * seats
        spilled = given.spills.get(key, 0.0)
        hot = rate / size > settings.grow_above * mean + settings.noise(rate) / size
        spilling = spilled > settings.spill_share * rate + settings.noise(spilled)
        extra = None
        copies = sum(_tally(homes, loads, replicas, unplanned)[1].values())
        within = not budget_slots or copies < budget_slots
        grows = rate >= settings.replicate_min_rps and size < limit and (hot or spilling or seated)
        if grows and within:
            extra = _extra_replica(homes, loads, replicas, members, given.slots, unplanned)
        paid = None
        # A key that gave a copy back within repay_after_s pays with nobody's slot: a burst's copy taken back in the
        # lull and paid for again at the next burst cost a neighbour its slot at every burst (the cool-down).
        repays = key not in cooled_at
        if grows and extra is None and seated and servable and repays:  # every slot planned: the lightest key pays
            # A payer busier than unplan_below_rps costs about a cold load per request it sends; an overloaded key's
            # queue grows without bound, which no such cost outweighs: then any key lighter than the copy's share
            # pays, the lightest first (the hot trace's tenant at 40x its rate: 5-6 requests in flight for 4 seats,
            # every light slot planned and none of its neighbours below the bound).
            share = rate / (size + 1)
            cheap = share if overloaded else min(share, settings.unplan_below_rps)
            paid = _paid_slot(
                homes, loads, replicas, members, fixed, unplanned, cheap, payer_noise, lightest_first=overloaded
            )
        if paid is not None:
            extra, payer = paid
            unplanned.add(payer)
            changes.append(Change(payer, homes[payer], homes[payer], f"unplanned: its slot on {extra} went to {key}"))
            fixed.add(payer)
        if extra is not None:
            below_since.pop(key, None)
            why = (
                f"seats: {demand:.3g} of its requests in flight over {size} replica(s) of {seats:g} seats"
                if seated
                else f"hot: {rate:.3g} req/s over {size} replica(s), mean {mean:.3g}"
                if hot
                else f"spilling: {spilled:.3g} of {rate:.3g} req/s left its {size} replica(s) for demand"
            )
            change(key, (*members, extra), why)
            fixed.add(key)
        elif (
            size > 1
            and spilled <= settings.spill_share / 2 * rate
            and (rate < settings.replicate_min_rps or rate / (size - 1) < settings.shrink_below * mean)
            and (seats <= 0 or demand / (size - 1) < settings.shrink_below * settings.seat_share * seats)
        ):
            since = below_since.setdefault(key, given.now)
            if given.now - since >= settings.shrink_after_s:
                del below_since[key]
                cooled_at[key] = given.now
                change(key, members[:-1], f"cooled: {rate:.3g} req/s, mean {mean:.3g}")
                fixed.add(key)
        else:
            below_since.pop(key, None)
    # 4. balance load, heaviest gain first, while it pays
    while budget > 0:
        move = _best_move(homes, loads, replicas, fixed | unplanned, allow_swap=budget >= 2, unplanned=unplanned)
        if move is None or move.gain <= settings.min_gain or move.gain * move.peak <= settings.noise(move.peak):
            break
        for key, after in move.sets:
            change(key, after, move.why)
            fixed.add(key)  # one move per key per interval
    load, adapters = _tally(homes, loads, replicas, unplanned)
    return Plan(_kept(homes, given), changes, below_since, load, adapters, unplanned, cooled_at)


def _extra_replica(
    homes: Mapping[str, Homes], loads: Mapping[str, float], replicas: Sequence[str], members: Homes, slots: int,
    unplanned: Collection[str] = (),
) -> str | None:  # fmt: skip
    """The replica a growing set gains: the least loaded one it lacks with a planned slot free, or None. A copy
    takes a slot: where the planned adapters fill a replica's ``slots`` it pushes out another key's adapter, whose
    requests then pay cold loads and push out others in turn (collide: 16 adapters in 16 slots; a noisy tenant's
    spills put its adapter on every replica: the quiet tenants' cold loads in 20 s went from none to 24-26, 0-2 now,
    docs/benchmarks.md). So a key hot by load grows only into spare slots too: with none, its demand queues on its
    own set (routing keeps its spills there up to ``placement.off_plan_queue``, gateway/fleet/plan_bound.py), not on
    its neighbours' adapters (unless it is sized by seats: ``_paid_slot``)."""
    load, adapters = _tally(homes, loads, replicas, unplanned)
    room = [r for r in replicas if r not in members and (not slots or adapters[r] < slots)]
    return min(room, key=lambda r: (load[r], r), default=None)


def _paid_slot(
    homes: Mapping[str, Homes], loads: Mapping[str, float], replicas: Sequence[str], members: Homes,
    fixed: Collection[str], unplanned: Collection[str], share: float, noise: Callable[[float], float],
    lightest_first: bool = False,
) -> tuple[str, str] | None:  # fmt: skip
    """Where a key sized by seats gains a copy while every slot is planned, and the key that pays for it: of the
    replicas it lacks, the least loaded one where a key planned there alone (not ``fixed``: pinned, warming, changed
    this interval), planned, sends fewer than ``share`` requests per second by more than the noise of its measured
    rate, and that replica's lightest such key (``lightest_first``: the lightest such key anywhere, its replica the
    least loaded among equals: what a payer costs is about a cold load per request it sends). None where no key is
    that light. The noise margin: a 4 s window measured collide's 0.7 req/s tenants below 0.2 often enough to unplan
    two of them (68 cold loads in 30 s)."""
    load, _ = _tally(homes, loads, replicas, unplanned)
    best: tuple[float, float, str, str] | None = None  # (replica's load, the key's rate, replica, key)
    for key, set_ in homes.items():
        if len(set_) != 1 or key in fixed or key in unplanned or set_[0] in members or set_[0] not in load:
            continue
        rate = loads.get(key, 0.0)
        if rate + noise(rate) >= share:
            continue
        candidate = (rate, load[set_[0]], set_[0], key) if lightest_first else (load[set_[0]], rate, set_[0], key)
        if best is None or candidate < best:
            best = candidate
    return None if best is None else (best[2], best[3])


def _over_budget(
    homes: Mapping[str, Homes], loads: Mapping[str, float], replicas: Sequence[str], slots: int, fixed: Collection[str],
    unplanned: Collection[str],
) -> list[str]:  # fmt: skip
    """The keys that give back their last copy so that the planned copies fit the slot budget: first copies on a
    replica whose planned adapters exceed its ``slots``, then any while the pool's copies exceed ``slots`` x
    replicas; the copy with the least load on it goes first. A key keeps its home (one copy at least), and a key
    ``fixed`` (pinned, evacuated, warming) is left as it is. Each key gives back one copy per interval."""
    if not slots:
        return []
    present = set(replicas)
    _, adapters = _tally(homes, loads, replicas, unplanned)
    copies = sum(adapters.values())
    budget = slots * len(replicas)
    taken: list[str] = []
    spare = sorted(
        (k for k, m in homes.items() if len(m) > 1 and k not in fixed and k not in unplanned and m[-1] in present),
        key=lambda k: (_share(k, homes, loads), k),
    )
    for over_replica in (True, False):
        for key in spare:
            if key in taken:
                continue
            last = homes[key][-1]
            if (adapters[last] > slots) if over_replica else copies > budget:
                taken.append(key)
                adapters[last] -= 1
                copies -= 1
    return taken


@dataclass(frozen=True)
class _Move:
    gain: float  # the share of ``peak`` (the source's load) the move takes off the pair's peak
    peak: float
    sets: tuple[tuple[str, Homes], ...]
    why: str


def _best_move(
    homes: Mapping[str, Homes], loads: Mapping[str, float], replicas: Sequence[str], fixed: Collection[str],
    allow_swap: bool, unplanned: Collection[str] = (),
) -> _Move | None:  # fmt: skip
    """The move (or swap) that lowers the most loaded replica's pair peak most, None when none lowers it (keys
    ``unplanned`` hold no slot: they neither move nor count)."""
    load, adapters = _tally(homes, loads, replicas, unplanned)
    source = max(replicas, key=lambda r: (load[r], r))
    peak = load[source]
    if peak <= 0:
        return None
    cap = math.ceil(sum(adapters.values()) / len(replicas))
    on: dict[str, list[str]] = {r: [] for r in replicas}
    for key, members in homes.items():
        for r in members:
            if r in on and key not in unplanned:
                on[r].append(key)
    # The lightest movable key on each replica: the swap partner a heavy key trades places with.
    lightest = {
        r: min((k for k in keys if k not in fixed), key=lambda k: (_share(k, homes, loads), k), default=None)
        for r, keys in on.items()
    }
    best: _Move | None = None
    for key in sorted(on[source]):
        if key in fixed:
            continue
        share = _share(key, homes, loads)
        if share <= 0:
            continue
        members = homes[key]
        for target in replicas:
            if target in members:
                continue
            after = tuple(target if r == source else r for r in members)
            if adapters[target] < cap:
                gain = (peak - max(peak - share, load[target] + share)) / peak
                why = f"balance: {share:.3g} req/s from {source} ({peak:.3g}) to {target} ({load[target]:.3g})"
                if best is None or gain > best.gain:
                    best = _Move(gain, peak, ((key, after),), why)
                continue
            partner = lightest[target]
            if not allow_swap or partner is None or source in homes[partner]:
                continue
            back = _share(partner, homes, loads)
            if back >= share:
                continue
            gain = (peak - max(peak - share + back, load[target] + share - back)) / peak
            why = f"balance: {share:.3g} req/s from {source} ({peak:.3g}) swapped with {back:.3g} on {target}"
            swapped = tuple(source if r == target else r for r in homes[partner])
            if best is None or gain > best.gain:
                best = _Move(gain, peak, ((key, after), (partner, swapped)), why)
    return best


def _share(key: str, homes: Mapping[str, Homes], loads: Mapping[str, float]) -> float:
    return loads.get(key, 0.0) / len(homes[key])


def _tally(
    homes: Mapping[str, Homes], loads: Mapping[str, float], replicas: Sequence[str], unplanned: Collection[str] = ()
) -> tuple[dict[str, float], dict[str, int]]:
    """Expected requests per second and planned adapters (keys) per replica; keys ``unplanned`` hold no slot and
    their (light) load goes where routing finds room, so neither counts."""
    load = dict.fromkeys(replicas, 0.0)
    adapters = dict.fromkeys(replicas, 0)
    for key, members in homes.items():
        if key in unplanned:
            continue
        share = loads.get(key, 0.0) / len(members)
        for r in members:
            if r in load:
                load[r] += share
                adapters[r] += 1
    return load, adapters


def _kept(homes: Mapping[str, Homes], given: PlanInput) -> dict[str, Homes]:
    """The sets the table keeps: those that differ from the key's ring home alone (the others go without saying)."""
    return {k: v for k, v in homes.items() if v != (given.ring_home(k),)}
