"""A consistent-hash ring per pool (uhashring, ketama-compatible) and each key's preference order.

Homes can be balanced over the keys the gateway knows ahead (tenants, or adapters). With a few keys per replica a
ring's arcs give one replica twice another's share, and its working set churns (docs/benchmarks.md measures the
cold loads). ``balance`` places every known key, in the order of its ring position, on the first replica of its
ring preference that has fewer than ``ceil(keys / replicas)`` keys: the same keys and replicas give the same homes
in every gateway, with no coordination. Other keys (sessions, tenants added at run time) keep their ring home.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from uhashring import HashRing

# Affinity keys are tenants, adapters or sessions; bound the memo so a flood of session ids cannot grow it forever.
_MEMO_LIMIT = 65_536
_SPACE = float(2**128)  # ketama's md5 positions


class Ring:
    def __init__(self, replica_ids: Sequence[str], vnodes: int) -> None:
        self.replica_ids = tuple(replica_ids)
        self._ring = HashRing(nodes={replica_id: {"vnodes": vnodes} for replica_id in replica_ids})
        self._memo: dict[str, tuple[str, ...]] = {}
        self._homes: dict[str, str] = {}  # balanced homes that differ from the ring's

    def preference(self, key: str) -> tuple[str, ...]:
        """Every replica once: the key's home first, then the rest clockwise from the key's point."""
        if not self.replica_ids:  # a discovery pool DNS has no replicas for yet
            return ()
        order = self._memo.get(key)
        if order is None:
            order = self._ring_order(key)
            home = self._homes.get(key)
            if home is not None:
                order = (home, *(replica_id for replica_id in order if replica_id != home))
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.clear()
            self._memo[key] = order
        return order

    def home(self, key: str) -> str:
        return self.preference(key)[0]

    def ring_home(self, key: str) -> str:
        """Where the ring alone puts ``key`` (what ``home`` is without balancing); "" while the pool is empty."""
        return self._ring_order(key)[0] if self.replica_ids else ""

    def balance(self, keys: Collection[str]) -> None:
        """Balance the homes of ``keys`` (replacing the previous set; empty: ring homes for every key)."""
        self._homes = balanced_homes(self._ring, self.replica_ids, set(keys))
        self._memo.clear()

    def arcs(self) -> list[tuple[float, float, str]]:
        """The ring as (start, end, replica) arcs in [0, 1): each point owns the keys up to it (for drawing)."""
        points = sorted(self._ring.get_points()) if self.replica_ids else []
        arcs, previous = [], 0.0
        for position, replica_id in points:
            end = position / _SPACE
            arcs.append((previous, end, replica_id))
            previous = end
        if points:  # keys past the last point wrap round to the first
            arcs.append((previous, 1.0, points[0][1]))
        return arcs

    def position(self, key: str) -> float:
        return float(self._ring.hashi(key)) / _SPACE

    def _ring_order(self, key: str) -> tuple[str, ...]:
        return tuple(self._ring.iterate_nodes(key, distinct=True))


def balanced_homes(ring: HashRing, replica_ids: Sequence[str], keys: Collection[str]) -> dict[str, str]:
    """Each key's home where it differs from its ring home: keys in ring-position order (ties by name) take the
    first replica of their ring preference with fewer than ``ceil(len(keys) / len(replicas))`` keys."""
    if not replica_ids or not keys:
        return {}
    cap = math.ceil(len(keys) / len(replica_ids))
    counts = dict.fromkeys(replica_ids, 0)
    moved: dict[str, str] = {}
    for key in sorted(keys, key=lambda k: (ring.hashi(k), k)):
        for rank, replica_id in enumerate(ring.iterate_nodes(key, distinct=True)):
            if counts[replica_id] < cap:
                counts[replica_id] += 1
                if rank:
                    moved[key] = replica_id
                break
    return moved
