"""A heap reserve made once at start-up, so that a young gateway's routing does not take page faults as its per-key
state grows.

Why: each key a pool routes for the first time keeps its state (gateway/fleet/keys.py: its entry, its candidates,
its reservation; about 450 bytes) until the pool's bound of keys is reached, so a young process's heap grows at
first sights, and CPython's small-object allocator takes that memory from the system a page at a time as it is
first touched: one first sight in eight or so took a minor page fault, 2-3 us more on a 10 us decision (the
benchmark's ``--causes``: 8-11% of first sights at 16 and 64 replicas, docs/benchmarks.md).

How: ``reserve`` allocates ``RESERVE_BYTES`` of small objects (each written, so every page is touched once now),
keeps one in ``KEEP_EVERY`` alive and frees the rest. CPython returns an arena (1 MiB) to the system only when
nothing in it is live; with a kept object in each, the freed pools stay mapped, resident and free for any size of
small object, and the allocator fills them before it maps a new arena. The gateway's resident memory starts that
much higher (it is what its keys' state would take anyway: 16 MiB is about 35,000 keys' state, of the 65,536 a pool
remembers). Under another allocator (``PYTHONMALLOC=malloc``, a debug build) it does no harm and may help less.
"""

from __future__ import annotations

RESERVE_BYTES = 16 * 1024 * 1024
# A bytes object of this length is one block of CPython's allocator (its largest size class is 512 bytes).
_BLOCK = 400
# One block kept in this many: about 450 KB apart, so at least two in each 1 MiB arena the reserve fills.
KEEP_EVERY = 1024

# What keeps the reserve's arenas mapped: never read.
_kept: list[bytes] = []


def reserve(size: int = RESERVE_BYTES) -> int:
    """Touch ``size`` bytes of the small-object heap now and leave them free for later allocations (see the module
    docstring); returns how many blocks it keeps alive. Once per process: the gateway calls it at start-up, after
    building its fleet (gateway/server.py), and ``make bench-decision`` does the same after building its pool."""
    if _kept:
        return 0
    blocks = [bytes(_BLOCK) for _ in range(size // (_BLOCK + 48))]  # bytes(n) writes its n zero bytes
    kept = blocks[::KEEP_EVERY]
    _kept.extend(kept)
    del blocks
    return len(kept)
