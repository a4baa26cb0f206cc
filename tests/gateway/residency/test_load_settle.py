"""A load that requests waited for holds the replica's lock until they have had their first byte (at most
``residency.load_settle_s``), and once a gateway's load lets the lock go, another gateway's load waiting for it tries
at once (its ``unlocked`` news), not at its next poll (gateway/residency/lifecycle.py, ``_settle`` and
``_poll_pause``; docs/benchmarks.md, "Three gateways: the lock's hand-over"). Over the in-process store, a real
redis-server and a real Redis Cluster; the gateways' signals joined by test_slot_signal's bus.

Why: vLLM runs a load between engine steps, so a load begun as the last one ends stalls the requests that waited for
the last one before their first step, and they pay for two loads; across gateways the polls took the lock 77-94 ms
after its release on average (churn trace, three gateways), and a wake at the release alone chained the loads."""

from __future__ import annotations

import asyncio

import pytest

from backends import registry
from gateway.config import ResidencyConfig
from gateway.residency import lifecycle as lifecycle_module
from gateway.residency.store import ResidencyStore
from tests.gateway.residency.fakes import FakeEngine, ref
from tests.gateway.residency.test_slot_signal import Bus, gateway, until_loading

SETTLE = ResidencyConfig(load_settle_s=60.0)  # the hold ends by the requests' first bytes here, never by the bound


async def test_a_load_holds_the_replica_until_its_requests_started_then_another_gateways_load_goes(
    store: ResidencyStore,
) -> None:
    """A's load of x had a request waiting (``first_byte``); B's load of y on r0 does not reach the engine while
    that request has not had its first byte, and does once it has."""
    engine, bus = FakeEngine(), Bus()
    a, b = gateway(store, engine, bus, SETTLE, max_adapters=4), gateway(store, engine, bus, SETTLE, max_adapters=4)
    assert await a.ensure("r0", ref("x"), first_byte=True)  # it waited for the load: x is resident, A holds r0
    later = asyncio.create_task(b.ensure("r0", ref("y")))
    await until_loading(b, "y")
    await asyncio.sleep(0.5)  # B polls r0's lock meanwhile (every 0.2 s at most): taken
    assert engine.loads[("r0", "y")] == 0 and not later.done()
    a.started("r0", "x")  # the request's first byte
    await asyncio.wait_for(later, 5)
    assert engine.loads[("r0", "y")] == 1


async def test_one_gateways_next_load_waits_for_the_last_loads_requests_too(store: ResidencyStore) -> None:
    """The hold is the replica's lock, this gateway's own included: its next load there waits as another's does.
    A request that gave up (``started`` from its error path) counts as started; so does one of two that started."""
    engine, bus = FakeEngine(), Bus()
    a = gateway(store, engine, bus, SETTLE, max_adapters=4)
    waiters = [asyncio.create_task(a.ensure("r0", ref("x"), first_byte=True)) for _ in range(2)]
    assert await asyncio.gather(*waiters) == [True, True]
    later = asyncio.create_task(a.ensure("r0", ref("y")))
    a.started("r0", "x")  # one of the two
    await asyncio.sleep(0.2)
    assert engine.loads[("r0", "y")] == 0 and not later.done()
    a.started("r0", "x")
    await asyncio.wait_for(later, 5)
    assert engine.loads[("r0", "y")] == 1


async def test_a_hold_ends_at_load_settle_s_whatever_its_requests_do(store: ResidencyStore) -> None:
    """A request that never has a first byte (a whole answer still being written, a stuck client) holds the replica
    ``load_settle_s`` at most; a load no request waited for (a fill, a warm-up) does not hold it at all."""
    engine, bus = FakeEngine(), Bus()
    short = ResidencyConfig(load_settle_s=0.05)
    a, b = gateway(store, engine, bus, short, max_adapters=4), gateway(store, engine, bus, short, max_adapters=4)
    await a.ensure("r0", ref("x"), first_byte=True)
    await asyncio.wait_for(b.ensure("r0", ref("y")), 5)
    c = gateway(store, engine, bus, SETTLE, max_adapters=4)
    await c.ensure("r0", ref("z"))  # nobody's first byte awaited
    await asyncio.wait_for(b.ensure("r0", ref("w")), 5)
    assert engine.loads[("r0", "y")] == engine.loads[("r0", "w")] == 1


async def test_an_engine_that_loads_as_a_request_among_the_others_is_not_held(store: ResidencyStore) -> None:
    """TensorRT-LLM takes an adapter with a one-token request (backends/triton.py), which stalls no other request:
    a hold would only delay the next load (the registry's ``loads_between_steps``)."""
    engine, bus = FakeEngine(), Bus()
    a, b = gateway(store, engine, bus, SETTLE, max_adapters=4), gateway(store, engine, bus, SETTLE, max_adapters=4)
    assert not registry.spec("triton").loads_between_steps and registry.spec("vllm").loads_between_steps
    a.settle_loads = False
    await a.ensure("r0", ref("x"), first_byte=True)
    await asyncio.wait_for(b.ensure("r0", ref("y")), 5)  # a minute of hold otherwise
    assert engine.loads[("r0", "y")] == 1


async def test_a_load_waiting_for_the_lock_tries_once_the_other_gateways_load_lets_it_go(
    store: ResidencyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's load of y waits for r0's lock, which A's load of x holds for its request; B's polls are a minute apart
    here, so only A's ``unlocked`` news, sent once its hold ended, can let B in before the test gives up."""
    monkeypatch.setattr(lifecycle_module, "_POLL_FIRST_S", 60.0)
    monkeypatch.setattr(lifecycle_module, "_POLL_LAST_S", 60.0)
    engine, bus = FakeEngine(), Bus()
    a, b = gateway(store, engine, bus, SETTLE, max_adapters=4), gateway(store, engine, bus, SETTLE, max_adapters=4)
    await a.ensure("r0", ref("x"), first_byte=True)
    later = asyncio.create_task(b.ensure("r0", ref("y")))
    await until_loading(b, "y")
    await asyncio.sleep(0.1)  # B took its first look at the lock: taken; it waits for its next poll, or the news
    a.started("r0", "x")
    await asyncio.wait_for(later, 5)  # a minute without the news
    assert engine.loads[("r0", "y")] == 1 and "unlocked" in [m["t"] for m in bus.published]
