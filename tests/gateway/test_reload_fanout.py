"""POST /admin/reload through one gateway reloads every gateway sharing the Redis, and answers with each one's
outcome and the digest of the config file it now runs. Two `tenantgate serve` processes, a real redis-server of
the test's own (no other test's gateways in its heartbeat set), a simulated replica."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import time
import types
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio

from gateway.reload_fanout import GATEWAY_ID, Fanout
from loadtests.faultkit import GatewayUnderTest
from loadtests.fleet import api_key, gateway_config
from loadtests.processes import free_port
from tests.redis_server import RedisServer
from tests.servers import EngineProcess

pytestmark = pytest.mark.timeout(180)


def _config(sim: EngineProcess, redis_url: str, port: int, tenants: dict[str, list[str]]) -> dict[str, Any]:
    adapters = {"a1": sim.adapters["a1"]}
    return gateway_config({"r0": sim.url}, tenants, adapters, port=port, extra={"state": {"redis_url": redis_url}})


@contextlib.contextmanager
def two_gateways(tmp_path: Path, sim: EngineProcess) -> Iterator[tuple[list[GatewayUnderTest], list[int], str]]:
    with RedisServer(log_path=tmp_path / "redis.log") as server:
        ports = [free_port(), free_port()]
        gateways = [
            GatewayUnderTest(tmp_path, _config(sim, server.url, port, {"acme": ["a1"]}), name=f"g{i}")
            for i, port in enumerate(ports)
        ]
        try:
            for gateway in gateways:
                gateway.start(timeout_s=60)
            members = redis.Redis.from_url(server.url)
            deadline = time.monotonic() + 20
            while members.zcard("tg:gateways") < 2:  # each has sent its first heartbeat
                assert time.monotonic() < deadline, "the gateways never joined"
                time.sleep(0.05)
            members.close()
            yield gateways, ports, server.url
        finally:
            for gateway in gateways:
                gateway.stop()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_reload_through_one_gateway_reloads_every_gateway(sim_engine: EngineProcess, tmp_path: Path) -> None:
    with two_gateways(tmp_path, sim_engine) as (gateways, ports, redis_url):
        first, second = gateways
        assert second.admin("GET", "/admin/route?tenant=newco").status_code == 400  # an unknown tenant
        # The ConfigMap changes in every pod: a tenant more.
        for gateway, port in zip(gateways, ports, strict=True):
            gateway.write_config(_config(sim_engine, redis_url, port, {"acme": ["a1"], "newco": ["a1"]}))
        answer = first.admin("POST", "/admin/reload").json()
        assert answer["status"] == "reloaded" and answer["missing"] == []
        outcomes = {a["gateway"]: (a["status"], a["config_digest"]) for a in answer["gateways"]}
        assert sorted(outcomes.values()) == sorted(("reloaded", _digest(g.config_path)) for g in gateways)
        assert answer["gateway"] in outcomes and len(outcomes) == 2
        # The other gateway serves the new tenant without anyone having asked it.
        assert second.admin("GET", "/admin/route?tenant=newco").status_code == 200
        completion = {"model": "a1", "prompt": "x", "max_tokens": 2}
        headers = {"Authorization": f"Bearer {api_key('newco')}"}
        assert (
            httpx.post(second.url + "/v1/completions", json=completion, headers=headers, timeout=30).status_code == 200
        )


def test_a_peer_that_refuses_says_so_and_scope_local_reloads_one(sim_engine: EngineProcess, tmp_path: Path) -> None:
    with two_gateways(tmp_path, sim_engine) as (gateways, _, _):
        first, second = gateways
        second.config_path.write_text("pools: [")  # this pod's copy is broken
        answer = first.admin("POST", "/admin/reload").json()
        statuses = {a["gateway"] == answer["gateway"]: a["status"] for a in answer["gateways"]}
        assert statuses == {True: "reloaded", False: "refused"}, answer
        [refused] = [a for a in answer["gateways"] if a["status"] == "refused"]
        assert "not valid YAML" in refused["error"]
        local = first.admin("POST", "/admin/reload?scope=local").json()
        assert local["status"] == "reloaded" and "gateways" not in local


# This gateway's own reload's answer, in the fan-out tests without a gateway process.
HERE = {"gateway": "here", "status": "reloaded"}

MakeFanout = Callable[..., tuple[Fanout, redis.asyncio.Redis, str]]


@pytest.fixture
async def here(redis_server: RedisServer) -> AsyncIterator[MakeFanout]:
    """``here(answer_wait_s=30.0)``: this gateway's fan-out (its own reload answers ``HERE``) under a key prefix of
    the test's own, a plain client on the same Redis (another gateway's, or an operator's), and the prefix; both
    clients closed after the test."""
    made: list[tuple[Fanout, redis.asyncio.Redis]] = []

    async def reload_here() -> dict[str, Any]:
        return HERE

    def make(answer_wait_s: float = 30.0) -> tuple[Fanout, redis.asyncio.Redis, str]:
        prefix = f"test-{uuid.uuid4().hex}"
        fanout = Fanout(
            redis_server.url, reload_here, operation_timeout_s=2.0, prefix=prefix, answer_wait_s=answer_wait_s
        )
        client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
        made.append((fanout, client))
        return fanout, client, prefix

    yield make
    for fanout, client in made:
        await client.aclose()
        await fanout._client.aclose()
        await fanout._subscriber.aclose()


async def test_an_unreadable_message_on_the_channel_is_skipped_and_the_next_request_answered(
    here: MakeFanout, caplog: pytest.LogCaptureFixture
) -> None:
    """Anything on the reload channel that is not a request (another version's message, or anyone's with Redis
    access) is logged and skipped; the subscription stays, so a request right behind it is answered. (It used to
    raise out of the follower: unsubscribed for a second, and the request published meanwhile lost.)"""
    fanout, client, prefix = here()
    follower = asyncio.create_task(fanout._follow())
    try:
        for _ in range(500):  # bounded poll: the follower has subscribed
            if (await client.pubsub_numsub(f"{prefix}:reload"))[0][1] == 1:
                break
            await asyncio.sleep(0.01)
        async with client.pubsub() as pubsub:
            await pubsub.subscribe("answers")
            for junk in ("not json", "[1]", '"text"', "[" * 100_000):  # the last: past the parser's depth
                await client.publish(f"{prefix}:reload", junk)
            await client.publish(f"{prefix}:reload", json.dumps({"from": "another", "reply": "answers"}))
            async with asyncio.timeout(5):
                answer = None
                while answer is None:
                    answer = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
        assert json.loads(answer["data"]) == HERE
        assert "unreadable message" in caplog.text and "not following" not in caplog.text
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower


async def test_an_unreadable_answer_is_skipped_and_the_reload_still_answers(here: MakeFanout) -> None:
    """An answer on the reply channel that is not an object, or names its gateway by anything but a string (another
    version's, or anyone's with Redis access), is skipped: each raised out of the asking gateway's reload before
    (a list there: TypeError, unhashable, from the set of gateways waited for), so its admin reload answered 500."""
    fanout, client, prefix = here(5.0)
    await client.zadd(f"{prefix}:gateways", {"another": time.time()})

    subscribed = asyncio.Event()
    # A peer that answers junk first, then its answer.
    answers = (
        "not json",
        "[1]",
        json.dumps({"gateway": ["another"], "status": "reloaded"}),
        json.dumps({"gateway": {"another": 1}}),
        json.dumps({"gateway": "another", "status": "reloaded"}),
    )
    peer = asyncio.create_task(_peer_answers(client, prefix, subscribed, answers))
    try:
        await asyncio.wait_for(subscribed.wait(), 10)
        answer = await fanout.everywhere(HERE)
        assert answer["missing"] == [] and [a["gateway"] for a in answer["gateways"]] == ["another", "here"]
        await peer
    finally:
        peer.cancel()


async def test_only_gateways_seen_within_15_s_are_waited_for_and_those_silent_for_30_s_are_missing(
    here: MakeFanout,
) -> None:
    """docs/operations.md, Every gateway: `missing` lists the gateways seen alive (a heartbeat within 15 s) that did
    not answer within 30 s; one last seen 16 s ago is not waited for."""
    assert inspect.signature(Fanout).parameters["answer_wait_s"].default == 30.0  # what the app builds it with
    fanout, client, prefix = here(0.3)
    await client.zadd(f"{prefix}:gateways", {"quiet": time.time() - 14, "gone": time.time() - 16})
    answer = await fanout.everywhere(HERE)
    assert answer["missing"] == ["quiet"] and [a["gateway"] for a in answer["gateways"]] == ["here"]


async def _peer_answers(
    client: redis.asyncio.Redis, prefix: str, subscribed: asyncio.Event, answers: tuple[str, ...]
) -> None:
    """Another gateway: subscribed to the reload channel (``subscribed`` set then), it takes one reload request and
    publishes ``answers``, in order, on its reply channel (bounded: 10 s for the request)."""
    async with client.pubsub() as pubsub:
        await pubsub.subscribe(f"{prefix}:reload")
        subscribed.set()
        async with asyncio.timeout(10):
            message = None
            while message is None:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
    reply = json.loads(message["data"])["reply"]
    for body in answers:
        await client.publish(reply, body)


async def _redis_now(client: redis.asyncio.Redis) -> float:
    seconds, micros = await client.time()
    return float(seconds) + micros / 1e6


@pytest.mark.parametrize("skew_s", [-60.0, 200.0])
async def test_a_gateway_whose_clock_is_skewed_waits_for_the_live_and_prunes_nobody(
    here: MakeFanout, monkeypatch: pytest.MonkeyPatch, skew_s: float
) -> None:
    """Membership is read on Redis' clock. Scored by the gateway's own, one a minute behind waited for a gateway
    silent for 20 s (dead: named missing after the whole answer wait), and one 200 s ahead pruned every other
    gateway from the set at its heartbeat and waited for none of them: their reload was silently skipped."""
    monkeypatch.setattr(  # this gateway's clock (the module's only one before the fix) is off by skew_s
        "gateway.reload_fanout.time", types.SimpleNamespace(time=lambda: time.time() + skew_s), raising=False
    )

    fanout, client, prefix = here(5.0)
    members = f"{prefix}:gateways"
    subscribed = asyncio.Event()

    # A live peer with a right clock: answers the reload.
    peer = asyncio.create_task(_peer_answers(client, prefix, subscribed, (json.dumps({"gateway": "another"}),)))
    beating = asyncio.create_task(fanout._heartbeat())
    try:
        now = await _redis_now(client)
        await client.zadd(members, {"another": now - 1, "gone": now - 20})
        await asyncio.wait_for(subscribed.wait(), 10)
        for _ in range(1000):  # bounded poll: this gateway's first heartbeat is in
            if await client.zscore(members, GATEWAY_ID) is not None:
                break
            await asyncio.sleep(0.01)
        assert await client.zscore(members, "another") is not None  # not pruned by a clock ahead
        answer = await fanout.everywhere(HERE)
        assert [a["gateway"] for a in answer["gateways"]] == ["another", "here"], answer
        # Nobody dead waited for: one that was would be named missing after the whole answer wait (not timed here:
        # a time bound under the 5 s wait failed on a starved machine without adding a case the list misses).
        assert answer["missing"] == [], answer
        await peer
    finally:
        for task in (peer, beating):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_a_members_key_of_another_type_is_replaced_and_the_reload_still_answers(
    here: MakeFanout,
) -> None:
    """Someone SETs a string where the gateways' sorted set lives: every heartbeat and every reload's read of the
    live gateways raised WRONGTYPE (StoreUnavailable), so no gateway's reload reached the others (and none was
    listed missing) until an operator deleted the key. The gateway owns the key: one of another type is deleted,
    and the heartbeat writes it again."""
    fanout, client, prefix = here(0.3)
    await client.set(f"{prefix}:gateways", "not a sorted set")
    answer = await fanout.everywhere(HERE)
    assert [a["gateway"] for a in answer["gateways"]] == ["here"] and answer["missing"] == []
    await client.set(f"{prefix}:gateways", "not a sorted set")
    await fanout._beat(keys=[f"{prefix}:gateways"], args=["gw-x", 150])
    assert await client.zrange(f"{prefix}:gateways", 0, -1) == ["gw-x"]
