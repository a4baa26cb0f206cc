"""A close ends even when a background task loses its cancellation (gateway/tasks.py): the registry's close under
load hung while its subscription's cancellation came out as the connect's timeout and the retry loop went on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.tasks import cancel_and_wait
from gateway.tenants import registry as registry_module
from gateway.tenants.registry import Registry
from loadtests.processes import free_port

pytestmark = pytest.mark.timeout(60)


async def _retrying(swallowed: list[int], stubborn: list[bool] | None = None) -> None:
    """A Redis retry loop whose call turns its first cancellation (every one while ``stubborn`` holds True) into
    the call's own timeout, as a cancel landing just as a connect times out can."""
    while True:
        try:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if swallowed and not (stubborn and stubborn[0]):
                    raise
                swallowed.append(1)
                raise TimeoutError("Timeout connecting to server") from None
        except Exception:
            await asyncio.sleep(0)


async def test_a_task_that_swallows_its_first_cancellation_is_cancelled_again() -> None:
    swallowed: list[int] = []
    task = asyncio.create_task(_retrying(swallowed), name="retrying")
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait([task, None], grace_s=0.05), 10)
    assert task.cancelled() and swallowed == [1]


async def test_a_task_that_never_ends_is_named_and_left_behind(caplog: pytest.LogCaptureFixture) -> None:
    swallowed: list[int] = []
    stubborn = [True]
    task = asyncio.create_task(_retrying(swallowed, stubborn), name="stubborn")
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="gateway.tasks"):
        await asyncio.wait_for(cancel_and_wait([task], grace_s=0.05, rounds=2), 10)
    assert not task.done() and len(swallowed) == 2
    assert "'stubborn' did not end after 2 cancellations" in caplog.text
    stubborn[0] = False  # the test's own task: it ends at the next cancellation
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_task_that_failed_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails(), name="failing")
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="gateway.tasks"):
        await cancel_and_wait([task])
    assert "'failing' ended with an error" in caplog.text


async def test_a_registry_closes_while_its_subscription_swallows_the_cancellation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    swallowed: list[int] = []

    async def channel_messages(subscriber: Any, channel: str, quiet_s: float | None = None) -> AsyncIterator[Any]:
        try:
            await asyncio.Event().wait()  # reconnecting
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(1)
            raise TimeoutError("Timeout connecting to server") from None
        yield {}

    monkeypatch.setattr(registry_module, "channel_messages", channel_messages)
    registry = Registry(f"redis://127.0.0.1:{free_port()}", operation_timeout_s=0.2)  # nothing listens there
    await registry.start(lambda: None)
    await asyncio.sleep(0)
    closing = asyncio.create_task(registry.close())
    # Not wait_for: on a timeout it cancels the close, whose await of the task then ends as if it had succeeded.
    done, _ = await asyncio.wait({closing}, timeout=5)
    assert closing in done, "the close waited for ever on the subscription task"
    assert swallowed == [1]
