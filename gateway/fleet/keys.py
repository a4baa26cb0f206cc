"""What a pool keeps per key it placed, in one object under one table: the key's candidates as last built (so a key
seen before skips its ring walk) and where it was served last (predicted_ttft's warm regime).

Why one object: these were two tables (a tuple per key in one, a dict of the key's replicas per key in the other),
each written at a key's first sight and each doubling at the same first sights, so that call rehashed both. One
table rehashes once, a key seen before is looked up once per decision, and a first sight writes about half the
bytes: the replica that served the key, and when, are two fields here, where a dict of one was about 300 bytes
with its table entry; a second replica's time goes to a dict made then (``served_more``).

The key's reservation state is here too (a KeyEntry is a routing/reservations.py Reservation: ``Pool.place`` hands
the entry to ``HomeReservations.arrived`` at the key's first request), so a first sight makes one object, not two;
its table is still the reservations' own, ordered by the key's activity: a reservation lapses 2 s after the key's
last request began or ended, this entry is forgotten by routing recency.
"""

from __future__ import annotations

from gateway.fleet.health import ReplicaHealth
from gateway.fleet.replica import Replica
from gateway.residency.lifecycle import ReplicaView
from gateway.routing.reservations import Reservation

# What the one pass (one_pass.py) reads of one replica, built once with the pool (Pool.records) and kept with each
# key's candidates (Pool._candidates): its id, its record, health and residency view, the objects themselves, so a
# decision looks none of them up by id.
Entry = tuple[str, Replica, ReplicaHealth, ReplicaView]


class KeyEntry(Reservation):
    """One key's candidates (``Pool._candidates`` fills them), the replicas that served it (``served``) and, as a
    ``Reservation``, its reservation state while it holds one (``HomeReservations`` sets and reads those fields)."""

    __slots__ = (
        "also_home",
        "homes",
        "order",
        "records",
        "resident",
        "served_at",
        "served_by",
        "served_more",
        "version",
    )

    # No __init__: Pool._candidates makes one with ``new_entry`` and sets every field (a Python __init__'s call cost
    # about 1,000 instructions at each first sight, more than the fields' stores).
    resident: frozenset[str]
    version: int
    order: tuple[str, ...]
    also_home: frozenset[str]
    records: tuple[Entry, ...]
    homes: frozenset[str]
    # The replica that served the key first (None: none yet) and when (time.monotonic); any other's time.
    served_by: str | None
    served_at: float
    served_more: dict[str, float] | None

    def served(self, replica_id: str, at: float) -> None:
        """``replica_id`` served the key at ``at``."""
        if self.served_by is None or self.served_by == replica_id:
            self.served_by, self.served_at = replica_id, at
        elif self.served_more is None:
            self.served_more = {replica_id: at}
        else:
            self.served_more[replica_id] = at

    def served_since(self, since: float) -> list[str]:
        """The replicas that served the key at ``since`` or later."""
        warm = [self.served_by] if self.served_by is not None and self.served_at >= since else []
        if self.served_more is not None:
            warm.extend(replica_id for replica_id, at in self.served_more.items() if at >= since)
        return warm


def new_entry(
    resident: frozenset[str],
    version: int,
    order: tuple[str, ...],
    also_home: frozenset[str],
    records: tuple[Entry, ...],
    homes: frozenset[str],
) -> KeyEntry:
    """A key's entry with its candidates and no replica served yet (where speed does not matter: tests, the
    spreading policies)."""
    entry = object.__new__(KeyEntry)
    entry.resident, entry.version, entry.order, entry.also_home = resident, version, order, also_home
    entry.records, entry.homes = records, homes
    entry.served_by, entry.served_at, entry.served_more = None, 0.0, None
    return entry
