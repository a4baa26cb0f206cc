"""The residency store contract, run against every implementation (the in-process one and a real redis-server)."""

from __future__ import annotations

import asyncio

from gateway.residency.store import FUTURE_MARK_S, ReplicaRecord, ResidencyStore


async def test_an_empty_replica_has_an_empty_record(store: ResidencyStore) -> None:
    assert await store.record("llama", "r0") == ReplicaRecord()


async def test_add_touch_remove(store: ResidencyStore) -> None:
    await store.add("llama", "r0", "support-acme", 100.0)
    await store.add("llama", "r0", "sql-globex", 50.0, pinned=True)
    await store.touch({("llama", "r0", "support-acme"): 120.0, ("llama", "r0", "sql-globex"): 40.0})
    record = await store.record("llama", "r0")
    assert record.resident == {"support-acme": 120.0, "sql-globex": 50.0}  # last use only moves forward
    assert record.pinned == frozenset({"sql-globex"})
    await store.remove("llama", "r0", ["sql-globex"])
    assert await store.record("llama", "r0") == ReplicaRecord({"support-acme": 120.0})


async def test_touch_does_not_bring_back_an_evicted_adapter(store: ResidencyStore) -> None:
    await store.add("llama", "r0", "support-acme", 100.0)
    await store.remove("llama", "r0", ["support-acme"])
    await store.touch({("llama", "r0", "support-acme"): 200.0})
    assert (await store.record("llama", "r0")).resident == {}


async def test_one_touch_of_several_replicas_and_pools_moves_each_own_record(store: ResidencyStore) -> None:
    await store.add("llama", "r0", "a", 1.0)
    await store.add("llama", "r0", "b", 1.0)
    await store.add("llama", "r1", "a", 1.0)
    await store.add("mistral", "r0", "c", 1.0)
    uses = {
        ("llama", "r0", "a"): 5.0,
        ("llama", "r0", "b"): 6.0,
        ("llama", "r1", "a"): 7.0,
        ("llama", "r1", "gone"): 8.0,
    }
    await store.touch({**uses, ("mistral", "r0", "c"): 0.5})  # an older use moves nothing
    assert (await store.record("llama", "r0")).resident == {"a": 5.0, "b": 6.0}
    assert (await store.record("llama", "r1")).resident == {"a": 7.0}  # a touch adds nothing
    assert (await store.record("mistral", "r0")).resident == {"c": 1.0}


async def test_pools_and_replicas_are_separate(store: ResidencyStore) -> None:
    await store.add("llama", "r0", "a", 1.0)
    await store.add("llama", "r1", "b", 1.0)
    await store.add("mistral", "r0", "c", 1.0)
    assert (await store.record("llama", "r0")).resident == {"a": 1.0}
    assert (await store.record("llama", "r1")).resident == {"b": 1.0}
    assert (await store.record("mistral", "r0")).resident == {"c": 1.0}


async def test_the_lock_has_one_holder_and_lapses(store: ResidencyStore) -> None:
    assert await store.acquire("llama", "r0", "gw1 a", ttl_s=1.0)  # outlives the next five round trips
    assert not await store.acquire("llama", "r0", "gw2 b", ttl_s=5)
    assert await store.acquire("llama", "r1", "gw2 b", ttl_s=5)  # another replica's lock is free
    assert (await store.record("llama", "r0")).lock_holder == "gw1 a"
    await store.release("llama", "r0", "gw2 b")  # not the holder: no effect
    assert not await store.acquire("llama", "r0", "gw2 b", ttl_s=5)
    for _ in range(500):  # bounded (10 s): the holder died, the lock lapses after its ttl
        if await store.acquire("llama", "r0", "gw2 b", ttl_s=5):
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the lock never lapsed")
    assert (await store.record("llama", "r0")).lock_holder == "gw2 b"
    await store.release("llama", "r0", "gw2 b")
    assert (await store.record("llama", "r0")).lock_holder is None


async def test_only_the_holder_renews_the_lock_and_never_after_its_release(store: ResidencyStore) -> None:
    assert await store.acquire("llama", "r0", "gw1 a", ttl_s=5)
    assert await store.renew("llama", "r0", "gw1 a", ttl_s=5)
    assert not await store.renew("llama", "r0", "gw2 b", ttl_s=5)  # not the holder
    assert (await store.record("llama", "r0")).lock_holder == "gw1 a"
    await store.release("llama", "r0", "gw1 a")
    # A renewal that lands after its holder let go (it was on its way) does not lock the replica again.
    assert not await store.renew("llama", "r0", "gw1 a", ttl_s=5)
    assert (await store.record("llama", "r0")).lock_holder is None
    assert await store.acquire("llama", "r0", "gw2 b", ttl_s=5)


async def test_reconcile_sets_a_last_use_far_in_the_future_to_now(store: ResidencyStore) -> None:
    """A mark stamped while a clock ran a year ahead (Redis' own, then set back) would stay: last uses only move
    forward. Reconciliation sets one more than FUTURE_MARK_S ahead of its now to now; a nearer one is kept."""
    await store.add("llama", "r0", "jumped", 100.0 + 365 * 86_400)
    await store.add("llama", "r0", "near", 100.0 + FUTURE_MARK_S - 1)
    await store.reconcile("llama", "r0", ["jumped", "near"], now=100.0)
    assert (await store.record("llama", "r0")).resident == {"jumped": 100.0, "near": 100.0 + FUTURE_MARK_S - 1}


async def test_a_lock_is_broken_only_for_a_holder_of_the_prefix_without_the_exception(store: ResidencyStore) -> None:
    """A restarted process gives back what its dead predecessor held (gateway/residency/owner.py): holders that
    carry its stable id ("s1:") but not its own incarnation ("s1:new/"); never its own, never another's."""
    assert await store.acquire("llama", "r0", "s1:old/p0 load", ttl_s=5)
    assert await store.acquire("llama", "r1", "s1:new/p0 load", ttl_s=5)
    assert await store.acquire("llama", "r2", "s2:old/p0 load", ttl_s=5)
    assert await store.acquire("llama", "r3", "s1 load", ttl_s=5)  # no colon after the id: another's
    assert [await store.break_lock("llama", r, "s1:", "s1:new/") for r in ("r0", "r1", "r2", "r3", "r4")] == [
        True, False, False, False, False,
    ]  # fmt: skip
    holders = [(await store.record("llama", r)).lock_holder for r in ("r0", "r1", "r2", "r3")]
    assert holders == [None, "s1:new/p0 load", "s2:old/p0 load", "s1 load"]


async def test_reconcile_makes_the_record_say_what_the_engine_has(store: ResidencyStore) -> None:
    await store.add("llama", "r0", "kept", 10.0, pinned=True)
    await store.add("llama", "r0", "gone", 20.0, pinned=True)
    before = await store.reconcile("llama", "r0", ["kept", "by-hand"], now=99.0)
    assert before.resident == {"kept": 10.0, "gone": 20.0}
    after = await store.record("llama", "r0")
    assert after.resident == {"kept": 10.0, "by-hand": 99.0}
    assert after.pinned == frozenset({"kept"})
