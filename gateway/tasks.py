"""Stopping background tasks at a close: cancel them and wait, bounded, even for one that swallows its cancellation.

A task's ``cancel()`` is a request that library code can lose (on Python 3.11 ``asyncio.wait_for`` returns the
awaited result and drops the cancellation when both land in the same turn), and an ``except Exception`` retry loop
carries on once a cancellation came out as another error. A close that cancels once and then awaits waits forever
for such a task: a registry's close under load hung for 120 s while its subscription reconnected, and a shutdown or
reload awaiting it would hang the same way. So every close cancels, waits a grace, cancels again what still runs,
and after the last round logs by name what never ended and goes on without it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

# How long a cancelled task gets to end before it is cancelled again: a cancelled Redis call ends at once, so this
# only bounds the wait for one that lost its cancellation.
GRACE_S = 1.0
ROUNDS = 3


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any] | None], *, grace_s: float = GRACE_S, rounds: int = ROUNDS
) -> None:
    """Cancel ``tasks`` (None skipped) and wait for them to end: those still running after ``grace_s`` are cancelled
    again, up to ``rounds`` cancellations in all. One that never ends is logged by its name and left behind, so the
    close goes on. A task that ended with an error is logged (not raised: the close it is part of goes on too)."""
    every = [task for task in tasks if task is not None]  # a copy: done callbacks may shrink the caller's set
    pending = {task for task in every if not task.done()}
    for _ in range(rounds):
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=grace_s)
    for task in pending:
        log.error("background task %r did not end after %d cancellations: left running", task.get_name(), rounds)
    for task in every:
        if task.done() and not task.cancelled() and (error := task.exception()) is not None:
            log.error("background task %r ended with an error", task.get_name(), exc_info=error)
