"""Ring points placed off the event loop, and shared while in use.

A pool's ring places vnodes x replicas points with an md5 each (about a second of CPU at 1,000 replicas:
gateway/routing/ring.py), and pools are built again at every reload and discovery change while the gateway serves.
So a rebuild ``prepare``s the new rings' geometries on a worker thread first, and the pools built on the event loop
then find them here (``geometry``). A reload that leaves a pool's replicas as they were places nothing: the serving
ring's geometry is still in use. The memo holds each geometry weakly (about 10 MB at 1,000 replicas), so one lives as
long as a ring, or a rebuild about to build one, holds it: past rings do not pile up with discovery changes.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

from gateway.config import GatewayConfig
from gateway.routing.ring import Geometry, place

_IN_USE: weakref.WeakValueDictionary[tuple[tuple[str, ...], int], Geometry] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()  # ``prepare`` fills it from a worker thread


def geometry(replica_ids: Sequence[str], vnodes: int) -> Geometry:
    """The geometry of ``replica_ids`` at ``vnodes``: one in use already, else placed now (O(points))."""
    key = (tuple(replica_ids), vnodes)
    with _LOCK:
        found = _IN_USE.get(key)
    if found is not None:
        return found
    placed = place(replica_ids, vnodes)
    with _LOCK:
        return _IN_USE.setdefault(key, placed)


def prepare(config: GatewayConfig) -> list[Geometry]:
    """The geometry of every pool ``config`` builds, placed where none is in use: run it on a worker thread before
    building a Fleet while requests are served, and hold what it returns until the Fleet is built."""
    vnodes = config.routing.vnodes
    return [geometry([r.id for r in pool.replicas], vnodes) for pool in config.pools if pool.replicas]
