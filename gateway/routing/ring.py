"""A consistent-hash ring per pool (uhashring, ketama-compatible) and each key's preference order.

uhashring places the points (ketama positions); walking them is ours. A decision needs only the first few
replicas of a key's order (``head``): one bisect into the sorted points, then steps clockwise until that many
distinct replicas are found, O(log points + K) at any fleet size, where building the whole order (uhashring's
``range`` copies its point list) costs O(points).

Homes can be balanced over the keys the gateway knows ahead (tenants, or adapters). With a few keys per replica a
ring's arcs give one replica twice another's share, and its working set churns (docs/benchmarks.md measures the
cold loads). ``balance`` places every known key, in the order of its ring position, on the first replica of its
ring preference that has fewer than ``ceil(keys / replicas)`` keys: the same keys and replicas give the same homes
in every gateway, with no coordination. Other keys (sessions, tenants added at run time) keep their ring home.

Placing the points is the costly part of a ring (an md5 per point: 160,000 points and about a second of CPU at
1,000 replicas), and a pool is built again at every reload and discovery change while the gateway serves. So a
ring's points, their index and what a key's first walk reads of them (each point's next distinct owners) are a
``Geometry`` of their own, which a pool takes placed in advance on a worker thread (gateway/fleet/rings.py).
"""

from __future__ import annotations

import itertools
import math
from array import array
from bisect import bisect
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

from uhashring import HashRing

try:  # CPython's own md5 (Modules/md5module.c): a key's hash in 1,300 instructions against OpenSSL's 2,500
    from _md5 import md5
except ImportError:  # a build without it (its hashes configured out)
    from hashlib import md5

# Affinity keys are tenants, adapters or sessions; bound the memo so a flood of session ids cannot grow it forever.
_MEMO_LIMIT = 65_536
_SPACE = float(2**128)  # ketama's md5 positions
_NONE: frozenset[str] = frozenset()
_VERSIONS = itertools.count()
_from_bytes = int.from_bytes  # one attribute lookup fewer per first sight


@dataclass(frozen=True)  # weakly referenced by gateway/fleet/rings.py's memo: no slots
class Geometry:
    """A ring's points, sorted, with their owners and the bucket index over them: what uhashring places, kept
    immutable so that every ring built on the same replicas and vnodes can share one."""

    positions: tuple[int, ...]
    # A tuple: a slice of it is the head a large ring's walk returns, with no copy.
    owners: tuple[str, ...]
    shift: int
    buckets: array[int]  # never written after it is made
    # What a key's first sight reads instead of walking (_table_ahead): on a small ring each point's first ``width``
    # distinct owners clockwise; on a large one how many points from each have distinct owners.
    rows: tuple[tuple[str, ...], ...] = ()
    width: int = 0
    runs: bytes = b""


def place(replica_ids: Sequence[str], vnodes: int) -> Geometry:
    """The points uhashring places for ``replica_ids`` at ``vnodes`` each: O(points), an md5 each, and what a walk
    reads of them (``_table_ahead``; where an event loop serves, on a worker thread: gateway/fleet/rings.py)."""
    points = HashRing(nodes={replica_id: {"vnodes": vnodes} for replica_id in replica_ids}).get_points()
    positions = tuple(position for position, _ in points)  # sorted, as uhashring keeps them
    shift, buckets = _bucket_index(positions)
    owners = tuple(owner for _, owner in points)
    rows, width, runs = _table_ahead(owners)
    return Geometry(positions, owners, shift, buckets, rows, width, runs)


class Ring:
    def __init__(self, replica_ids: Sequence[str], vnodes: int, geometry: Geometry | None = None) -> None:
        """``geometry``: the points already placed for these replicas and vnodes (else placed here)."""
        self.replica_ids = tuple(replica_ids)
        shape = (geometry or place(replica_ids, vnodes)) if replica_ids else None
        self._geometry = shape  # what gateway/fleet/rings.py's memo holds weakly: kept while this ring lives
        self._positions: tuple[int, ...] = shape.positions if shape else ()
        self._owners: tuple[str, ...] = shape.owners if shape else ()
        self._shift, self._buckets = (shape.shift, shape.buckets) if shape else _bucket_index(())
        self._rows, self._width, self._runs = (shape.rows, shape.width, shape.runs) if shape else ((), 0, b"")
        self._size = len(self.replica_ids)
        self._heads: dict[tuple[str, int], tuple[str, ...]] = {}
        # Renewed whenever a key's order may change (balanced homes, the placement table): what callers derived
        # from the orders under another version is stale. Unique across rings, so a new ring is never mistaken.
        self.version = next(_VERSIONS)
        self._homes: dict[str, str] = {}  # balanced homes that differ from the ring's
        # Replica sets from the placement table (homes from traffic), home first: they come before the ring's order.
        self._sets: dict[str, tuple[str, ...]] = {}
        # Per key, its set beyond its home, where that is not empty (``also_home``; read inline by the pool).
        self.also_homes: dict[str, frozenset[str]] = {}

    def preference(self, key: str) -> tuple[str, ...]:
        """Every replica once: the key's home first, then the rest clockwise from the key's point (O(points): for
        the status page and explanations; a decision takes ``head``)."""
        return self.head(key, len(self.replica_ids))

    def head(self, key: str, count: int) -> tuple[str, ...]:
        """The first ``count`` replicas of ``key``'s preference order (all of them when the pool is smaller)."""
        if not self.replica_ids:
            return ()
        memo_key = (key, count)
        order = self._heads.get(memo_key)
        if order is None:
            order = self.head_unremembered(key, count)
            if len(self._heads) >= _MEMO_LIMIT:
                self._heads.clear()
            self._heads[memo_key] = order
        return order

    def home(self, key: str) -> str:
        return self.head(key, 1)[0]

    def ring_home(self, key: str) -> str:
        """Where the ring alone puts ``key`` (what ``home`` is without balancing); "" while the pool is empty."""
        return self.head_unremembered(key, 1, homes=False)[0] if self.replica_ids else ""

    def balance(self, keys: Collection[str]) -> None:
        """Balance the homes of ``keys`` (replacing the previous set; empty: ring homes for every key)."""
        self._homes = balanced_homes(self, set(keys))
        self._heads.clear()
        self.version = next(_VERSIONS)

    def balanced_home(self, key: str) -> str:
        """The home without the placement table: balanced, else the ring's; "" while the pool is empty."""
        return self._homes.get(key) or self.ring_home(key)

    def install(self, sets: Mapping[str, tuple[str, ...]]) -> None:
        """Route by the placement table's replica sets (replacing the previous ones): a key's set comes first in
        its order, home first; replicas the pool does not have are left out."""
        known = set(self.replica_ids)
        self._sets = {key: kept for key, members in sets.items() if (kept := tuple(r for r in members if r in known))}
        self.also_homes = {key: frozenset(kept[1:]) for key, kept in self._sets.items() if len(kept) > 1}
        self._heads.clear()
        self.version = next(_VERSIONS)

    def also_home(self, key: str) -> frozenset[str]:
        """The key's replica set beyond its home (empty without a placement table, or for a set of one)."""
        return self.also_homes.get(key, _NONE)

    def replica_set(self, key: str) -> tuple[str, ...]:
        """The key's replica set as routing reads it: the table's, else its one (balanced or ring) home."""
        return self._sets.get(key) or ((self.balanced_home(key),) if self.replica_ids else ())

    def arcs(self) -> list[tuple[float, float, str]]:
        """The ring as (start, end, replica) arcs in [0, 1): each point owns the keys up to it (for drawing)."""
        points = list(zip(self._positions, self._owners, strict=True))  # sorted by position
        arcs, previous = [], 0.0
        for position, replica_id in points:
            end = position / _SPACE
            arcs.append((previous, end, replica_id))
            previous = end
        if points:  # keys past the last point wrap round to the first
            arcs.append((previous, 1.0, points[0][1]))
        return arcs

    def position(self, key: str) -> float:
        return float(key_point(key)) / _SPACE

    def hashi(self, key: str) -> int:
        """``key``'s point on the ring (ketama's md5 position)."""
        return key_point(key)

    def head_unremembered(self, key: str, count: int, homes: bool = True) -> tuple[str, ...]:
        """``head`` without its memo, for a caller that keeps what it derives from it (under ``version``): the first
        ``count`` of ``key``'s distinct owners clockwise; with ``homes``, its homes before them (the placement
        table's replica set, else its balanced home). One Python call at a key's first sight (the pool's
        ``_candidates`` calls it): the walk itself, not a wrapper around it (about 390 instructions fewer)."""
        if count > self._size:
            count = self._size
        first: tuple[str, ...] = ()
        if homes and (self._sets or self._homes):
            members = self._sets.get(key)
            if members is None:
                home = self._homes.get(key)
                members = (home,) if home is not None else ()
            first = members
        if len(first) >= count:
            return first[:count]
        # At every key's first sight: its point (key_point) and the first ring point after it (_first_after), inline
        # (two Python calls fewer); past the last point, the first.
        point = _from_bytes(md5(key.encode()).digest(), "big")
        bucket = point >> self._shift
        buckets = self._buckets
        index = bisect(self._positions, point, buckets[bucket], buckets[bucket + 1])
        owners = self._owners
        if index == len(owners):
            index = 0
        rows = self._rows
        if rows:
            if count <= self._width:  # a small ring: each point's distinct owners, tabled with its geometry
                ahead = rows[index]
                if not first:
                    return ahead[:count]
                rest = [owner for owner in ahead if owner not in first]
                if len(first) + len(rest) >= count:
                    return first + tuple(rest[: count - len(first)])
        elif not first:
            # A large ring: the next few points nearly always have distinct owners, which the geometry's runs say.
            if self._runs[index] >= count:
                return owners[index : index + count]
        else:
            ahead = first + owners[index : index + count - len(first)]
            if len(ahead) == count and len(set(ahead)) == count:
                return ahead
        return _distinct_owners(owners, index, count, first)

    def _first_after(self, point: int) -> int:
        """The index of the first ring point after ``point`` (``total`` past the last): a bisect within the point's
        bucket of the index, so a key's first sight reads two or three of the 160 x replicas points, not the 17 or
        so a bisect over all of them reads (each one a cache miss at 1,000 replicas: 1 us of the walk)."""
        bucket = point >> self._shift
        buckets = self._buckets
        return bisect(self._positions, point, buckets[bucket], buckets[bucket + 1])

    def _owners_from(self, key: str) -> Iterator[str]:
        """Every point's owner clockwise from ``key``'s point, once round the ring (repeats included)."""
        positions, owners = self._positions, self._owners
        total = len(positions)
        start = bisect(positions, key_point(key))
        for step in range(total):
            yield owners[(start + step) % total]

    def distinct_from(self, key: str) -> Iterator[str]:
        """The ring's own order for ``key`` (no balanced homes), lazily: stop as soon as you have what you need."""
        seen: set[str] = set()
        for owner in self._owners_from(key):
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.replica_ids):
                    return


def key_point(key: str) -> int:
    """``key``'s point on the ring: uhashring's own hash (the md5 of the key as a 128-bit integer), computed from
    the digest's bytes rather than its hex text (0.44 us against 0.57; tests/gateway/routing holds them equal), by
    CPython's built-in md5 where there is one (runs at every key's first sight: see the import)."""
    return int.from_bytes(md5(key.encode()).digest(), "big")


def _distinct_owners(owners: Sequence[str], index: int, count: int, first: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The first ``count`` distinct owners from point ``index`` clockwise, after ``first`` (a plain index walk, not
    _owners_from's generator); fewer when the ring has fewer."""
    if not first and index + 2 * count <= len(owners):
        # The next 2 x count points, deduplicated in order by one dict (in C): nearly always count distinct owners
        # already, a third of the walk's cost at 8 of 64 replicas; else the walk.
        ahead = tuple(dict.fromkeys(owners[index : index + 2 * count]))
        if len(ahead) >= count:
            return ahead[:count]
    found = list(first)
    total = len(owners)
    for _ in range(total):
        if index == total:
            index = 0
        owner = owners[index]
        index += 1
        if owner not in found:
            found.append(owner)
            if len(found) >= count:
                break
    return tuple(found)


# A ring of this many points or fewer tables the first distinct owners from every point, this many of them (the
# default routing.candidates), with its geometry: on a small ring the next points repeat owners, so a walk takes many
# steps where a large ring's next few points are distinct. 16,384 points: about 100 replicas at 160 vnodes, about
# 2 MB. A larger ring keeps, per point, how many points from it have distinct owners (up to _RUN_CAP), one byte each:
# a key's first sight then takes one slice where it tests a set. Made with the geometry, on a worker thread where the
# gateway serves (gateway/fleet/rings.py): a row made at its point's first use cost a key's first sight about 8,600
# instructions of its 100,000, and made on the event loop with the ring, the table took 29-46 ms per 100-replica pool.
_TABLE_POINTS = 16_384
_TABLE_WIDTH = 8
_RUN_CAP = 255


def _table_ahead(owners: Sequence[str]) -> tuple[tuple[tuple[str, ...], ...], int, bytes]:
    """A small ring's rows, each point's first ``width`` distinct owners clockwise (``_TABLE_WIDTH``, fewer on a
    smaller ring), and their width; a large ring's runs (``_distinct_runs``)."""
    if not owners:
        return (), 0, b""
    if len(owners) > _TABLE_POINTS:
        return (), 0, _distinct_runs(owners)
    width = min(_TABLE_WIDTH, len(set(owners)))
    total = len(owners)
    rows: list[tuple[str, ...]] = [()] * total
    # From the last point back: a point's row is its owner, then the next point's row without it (one walk, at the
    # last point, which wraps round).
    row = rows[-1] = _distinct_owners(owners, total - 1, width)
    for index in range(total - 2, -1, -1):
        owner = owners[index]
        if row[0] != owner:  # else the same row, shared
            if owner in row:
                at = row.index(owner)
                row = (owner, *row[:at], *row[at + 1 :])
            else:
                row = (owner, *row[: width - 1])
        rows[index] = row
    return tuple(rows), width, b""


def _distinct_runs(owners: Sequence[str]) -> bytes:
    """Per point, how many points from it (not wrapping round) have distinct owners, up to ``_RUN_CAP``: one more
    than the next point's, but short of the next point with its own owner."""
    total = len(owners)
    runs = bytearray(total)
    next_at: dict[str, int] = {}
    run = 0
    for index in range(total - 1, -1, -1):
        owner = owners[index]
        run += 1
        apart = next_at.get(owner, total) - index
        if apart < run:
            run = apart
        if run > _RUN_CAP:
            run = _RUN_CAP
        runs[index] = run
        next_at[owner] = index
    return bytes(runs)


# The index has about one bucket per ring point, and never fewer than this many.
_MIN_INDEX_BITS = 4


def _bucket_index(positions: Sequence[int]) -> tuple[int, array[int]]:
    """An index of the sorted ``positions``: ``buckets[b]`` is the first index whose position's top bits are
    ``b`` or more (the last entry is ``len(positions)``); returns the shift that gives a position's bucket. An
    array of 32-bit indexes: 0.5 MB at 1,000 replicas, where a list would hold an int object per bucket."""
    bits = max(_MIN_INDEX_BITS, len(positions).bit_length() - 1)
    shift = 128 - bits
    count = 1 << bits
    buckets = array("I", bytes(4 * (count + 1)))
    bucket = 0
    for index, position in enumerate(positions):
        top = position >> shift
        while bucket <= top:
            buckets[bucket] = index
            bucket += 1
    while bucket <= count:
        buckets[bucket] = len(positions)
        bucket += 1
    return shift, buckets


def balanced_homes(ring: Ring, keys: Collection[str]) -> dict[str, str]:
    """Each key's home where it differs from its ring home: keys in ring-position order (ties by name) take the
    first replica of their ring preference with fewer than ``ceil(len(keys) / len(replicas))`` keys."""
    replica_ids = ring.replica_ids
    if not replica_ids or not keys:
        return {}
    cap = math.ceil(len(keys) / len(replica_ids))
    counts = dict.fromkeys(replica_ids, 0)
    moved: dict[str, str] = {}
    for key in sorted(keys, key=lambda k: (ring.hashi(k), k)):
        for rank, replica_id in enumerate(ring.distinct_from(key)):
            if counts[replica_id] < cap:
                counts[replica_id] += 1
                if rank:
                    moved[key] = replica_id
                break
    return moved
