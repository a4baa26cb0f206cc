"""A consistent-hash ring per pool (uhashring, ketama-compatible) and each key's preference order."""

from __future__ import annotations

from collections.abc import Sequence

from uhashring import HashRing

# Affinity keys are tenants, adapters or sessions; bound the memo so a flood of session ids cannot grow it forever.
_MEMO_LIMIT = 65_536
_SPACE = float(2**128)  # ketama's md5 positions


class Ring:
    def __init__(self, replica_ids: Sequence[str], vnodes: int) -> None:
        self.replica_ids = tuple(replica_ids)
        self._ring = HashRing(nodes={replica_id: {"vnodes": vnodes} for replica_id in replica_ids})
        self._memo: dict[str, tuple[str, ...]] = {}

    def preference(self, key: str) -> tuple[str, ...]:
        """Every replica once, clockwise from the key's point: the first is the key's home."""
        if not self.replica_ids:  # a discovery pool DNS has no replicas for yet
            return ()
        order = self._memo.get(key)
        if order is None:
            order = tuple(self._ring.iterate_nodes(key, distinct=True))
            if len(self._memo) >= _MEMO_LIMIT:
                self._memo.clear()
            self._memo[key] = order
        return order

    def home(self, key: str) -> str:
        return self.preference(key)[0]

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
