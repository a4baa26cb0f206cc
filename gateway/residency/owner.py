"""This process's name on the replicas' store locks, kept across its restarts where its predecessor is provably dead.

A gateway killed while it holds a replica's lock (``tg:{pool:replica}:lock``) leaves it for ``residency.lock_ttl_s``:
restarted, its own start-up reconciliation waited that long on each such replica before it turned ready. With
``state.identity_dir`` a process claims an identity there: the first ``owner-N`` file it can ``flock`` (exclusive,
non-blocking, held until the process dies, when the kernel lets it go), whose content is a random id (written on the
first claim, read back by every later one). Lock holders are ``"{stable}:{incarnation}/{pool's own} {purpose}"``:
``stable`` the file's id, ``incarnation`` random per process.

Why two live gateways can never both hold a lock: the store's lock is ``SET NX`` by holder string, and this only
adds that at start-up a process deletes a lock whose holder carries its ``stable`` id but not its own incarnation
(``PoolResidency.break_dead_locks``). A process uses a ``stable`` id only while it holds that file's ``flock``, so
while a process holds it no other live process has that id: the lock it deletes is a dead process's. Two processes
that share the directory claim different files; two that do not (separate hosts or pods) wrote their own random
ids. A copy of the directory taken while a process ran (a volume snapshot restored twice) would break this: give
each gateway its own directory (an ``emptyDir`` survives a container's restart in its pod, not the pod's).
Without ``state.identity_dir`` every process is new (random ids) and a dead one's lock lapses after the ttl.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Files tried in the directory: as many processes sharing it at once as this (serve --workers N: N of them).
MAX_SLOTS = 1024
_ID = re.compile(r"[0-9a-f]{12}")


@dataclass(frozen=True)
class ProcessOwner:
    stable: str  # the claimed file's id; random when unclaimed
    incarnation: str  # random per process
    claimed: bool = False  # stable was read from (or written to) a file this process holds

    @property
    def live(self) -> str:
        """What every lock holder of this process begins with."""
        return f"{self.stable}:{self.incarnation}/"

    @property
    def any_run(self) -> str:
        """What every lock holder of a process with this stable id begins with (this one's and its predecessors')."""
        return f"{self.stable}:"


_current = ProcessOwner(uuid.uuid4().hex[:12], uuid.uuid4().hex[:8])
_held: dict[Path, tuple[int, ProcessOwner]] = {}  # directory -> (the flocked file's descriptor, what it gave)


def current() -> ProcessOwner:
    """This process's owner: the last ``claim``'s, else random (nothing to inherit)."""
    return _current


def claim(directory: Path) -> ProcessOwner:
    """Claim an identity in ``directory`` for the rest of this process's life (once per directory: again, the same).
    Raises ``OSError`` when the directory cannot be made or written, or ``RuntimeError`` when every file is held."""
    global _current
    directory = directory.resolve()
    if directory in _held:
        _current = _held[directory][1]
        return _current
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for slot in range(MAX_SLOTS):
        path = directory / f"owner-{slot}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live process holds it
            os.close(fd)
            continue
        stable = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        if not _ID.fullmatch(stable):  # never claimed (or unreadable): a fresh id from now on
            stable = uuid.uuid4().hex[:12]
            os.ftruncate(fd, 0)
            os.pwrite(fd, stable.encode(), 0)
            os.fsync(fd)
        owner = ProcessOwner(stable, uuid.uuid4().hex[:8], claimed=True)
        _held[directory] = (fd, owner)
        _current = owner
        log.info("lock owner %s (%s)", owner.live, path)
        return owner
    raise RuntimeError(f"{directory}: all {MAX_SLOTS} identity files are held by live processes")
