"""The homes table every gateway routes by: a version, and per pool each placed key's replica set (home first).

A key moving (or gaining a replica) is published before its traffic moves: ``homes`` holds its new set and
``warming`` the set requests keep going to until the adapter is resident at every new member (make before break,
placer.py). ``unplanned`` names the keys whose adapter has no planned slot (each paid for a heavy key's copy,
plan.py): they are routed by their set, and the fill plans nothing for them. ``why`` says why each key's set is
what it is; ``below_since``, ``warming_since`` and ``cooled_at`` (wall-clock
seconds) carry the leader's timers over to the next leader. Encoded as compact JSON. Pure: no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.placement.plan import Homes


@dataclass(frozen=True)
class PoolTable:
    homes: Mapping[str, Homes] = field(default_factory=dict)  # the plan's sets
    warming: Mapping[str, Homes] = field(default_factory=dict)  # key -> the set routed by while the new one warms
    warming_since: Mapping[str, float] = field(default_factory=dict)
    why: Mapping[str, str] = field(default_factory=dict)
    below_since: Mapping[str, float] = field(default_factory=dict)
    unplanned: frozenset[str] = frozenset()
    # When a key last gave a copy back as its demand fell: it makes no key pay for a copy until repay_after_s on.
    cooled_at: Mapping[str, float] = field(default_factory=dict)

    def routed(self) -> dict[str, Homes]:
        """The sets requests go to now: a warming key's previous set, every other key's planned one."""
        return {key: self.warming.get(key, members) for key, members in self.homes.items()}


@dataclass(frozen=True)
class HomesTable:
    version: int = 0
    leader: str = ""
    pools: Mapping[str, PoolTable] = field(default_factory=dict)
    # Keys whose set changed in the interval that made this version (per pool), for the metric.
    moves: int = 0
    # Planned from a whole window of traffic (traffic.window_s): before that a leader applies only the pins and
    # evacuations, and routing confines no spill to the sets (gateway/fleet/fleet.py, install_homes). A table of the
    # version before this flag counts as measured, as it confined then.
    measured: bool = True


EMPTY = HomesTable()


def encode(table: HomesTable) -> str:
    body = {
        "version": table.version,
        "leader": table.leader,
        "moves": table.moves,
        "measured": table.measured,
        "pools": {
            name: {
                "homes": {k: list(v) for k, v in pool.homes.items()},
                "warming": {k: list(v) for k, v in pool.warming.items()},
                "warming_since": dict(pool.warming_since),
                "why": dict(pool.why),
                "below_since": dict(pool.below_since),
                "unplanned": sorted(pool.unplanned),
                "cooled_at": dict(pool.cooled_at),
            }
            for name, pool in table.pools.items()
        },
    }
    return json.dumps(body, separators=(",", ":"), sort_keys=True)


def decode(text: str) -> HomesTable:
    """``encode``'s inverse; raises ValueError (or TypeError, KeyError) on anything else."""
    try:
        body = json.loads(text)
    except RecursionError as exc:  # nested past the parser's depth: as unreadable as any other noise
        raise ValueError("the homes table is nested too deep") from exc
    if not isinstance(body, dict):
        raise ValueError("the homes table is not an object")

    def sets(raw: Any) -> dict[str, Homes]:
        return {str(k): tuple(str(r) for r in v) for k, v in dict(raw).items() if v}

    def times(raw: Any) -> dict[str, float]:
        found = {str(k): float(v) for k, v in dict(raw).items()}
        if not all(math.isfinite(t) for t in found.values()):
            raise ValueError("a time in the homes table is not finite")
        return found

    def pool_table(pool: Any) -> PoolTable:
        warming = sets(pool["warming"])
        since = times(pool["warming_since"])
        # A warming key without its start (a table written by hand, or by another version) would never time out:
        # it counts as started at 0, so the next leader gives its move up.
        since = {key: since.get(key, 0.0) for key in warming}
        why = {str(k): str(v) for k, v in dict(pool["why"]).items()}
        # A table of the version before unplanned keys has none.
        unplanned = frozenset(str(key) for key in pool.get("unplanned", ()))
        # Nor cool-downs: a key of such a table may pay at once, as it could then.
        cooled = times(pool.get("cooled_at", {}))
        return PoolTable(sets(pool["homes"]), warming, since, why, times(pool["below_since"]), unplanned, cooled)

    def whole(raw: Any) -> int:
        # int() of an infinite float (JSON's Infinity, or 1e400) raises OverflowError, which went past the store's
        # handling: out of every placement tick, and out of a starting gateway's first look.
        try:
            return int(raw)
        except OverflowError as exc:
            raise ValueError(f"not a whole number: {raw!r}") from exc

    pools = {str(name): pool_table(pool) for name, pool in dict(body["pools"]).items()}
    measured = body.get("measured", True)
    if not isinstance(measured, bool):
        raise ValueError(f"measured is not a boolean: {measured!r}")
    return HomesTable(whole(body["version"]), str(body["leader"]), pools, whole(body["moves"]), measured)
