"""A consistent-hash ring per pool (uhashring, ketama-compatible) and each key's preference order."""

from __future__ import annotations

from collections.abc import Sequence

from uhashring import HashRing

# Affinity keys are tenants, adapters or sessions; bound the memo so a flood of session ids cannot grow it forever.
_MEMO_LIMIT = 65_536


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
