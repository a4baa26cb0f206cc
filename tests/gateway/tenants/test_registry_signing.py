"""Signed registry entries (issue 20, "Shared-state and operator surfaces"): one PUBLISH on tg:registry used to add
a working key for any tenant. Now every entry, stored and published, carries an HMAC and a version: a forged
entry, or a replayed one (an add_key after its revoke_key), is refused, logged and counted. Against a real
redis-server."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio

from gateway.app import registry_key
from gateway.config import ConfigError, StateConfig
from gateway.observe.metrics import GatewayMetrics
from gateway.residency.store import StoreUnavailable
from gateway.tenants.identity import hash_key
from gateway.tenants.registry import Registry
from gateway.tenants.signing import Refused, Signer, derived_key
from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config, gateway_process, simulated_replicas, write_adapters
from loadtests.processes import free_port
from tests.gateway.tenants.test_registry import TENANTS, base_config
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(120)

KEY = b"registry-signing-key-for-the-tests-0123456789"


def test_an_envelope_opens_only_unchanged_and_under_its_key() -> None:
    signer = Signer(KEY)
    change = {"kind": "add_key", "tenant_id": "acme", "key_hash": hash_key("k")}
    envelope = signer.envelope(change, 3)
    assert signer.open(json.dumps(envelope)) == (change, 3)
    for tampered in (
        {**envelope, "version": 4},
        {**envelope, "change": {**change, "tenant_id": "globex"}},
        {"kind": "add_key", "tenant_id": "acme", "key_hash": hash_key("k")},  # what was published before
        {**envelope, "mac": "0" * 64},
    ):
        with pytest.raises(Refused) as refused:
            signer.open(json.dumps(tampered))
        assert refused.value.reason == "forged"
    for other in (Signer(b"another key"), Signer(None)):
        with pytest.raises(Refused):
            other.open(json.dumps(envelope))
    head = signer.head(3, {"key:x": 3})
    assert signer.open_head(json.dumps(head)) == (3, head["digest"])
    with pytest.raises(Refused, match="head"):
        signer.open_head(json.dumps({**head, "version": 9}))


def test_an_entry_or_head_nested_past_the_parsers_depth_is_refused() -> None:
    """Anyone with Redis access can write an entry nested deeper than the JSON parser recurses: it is refused like
    any other forgery (a RecursionError went past the checks, out of the registry's read)."""
    signer = Signer(KEY)
    deep = '{"change": ' + "[" * 100_000
    with pytest.raises(Refused) as refused:
        signer.open(deep)
    assert refused.value.reason == "forged"
    with pytest.raises(Refused) as refused:
        signer.open_head(deep)
    assert refused.value.reason == "altered"


def test_the_signing_key_is_configured_or_derived_from_the_admin_token() -> None:
    configured = StateConfig(registry_key_env="TEST_REGISTRY_KEY")
    assert registry_key(configured, "an-admin-token", {"TEST_REGISTRY_KEY": "k1"}) == b"k1"
    with pytest.raises(ConfigError, match="TEST_REGISTRY_KEY is not set"):
        registry_key(configured, "an-admin-token", {})
    assert registry_key(StateConfig(), "an-admin-token", {}) == derived_key("an-admin-token")
    assert registry_key(StateConfig(), "", {}) is None  # then nothing from Redis is believed


def refused(metrics: GatewayMetrics, reason: str, source: str) -> float:
    value = metrics.registry.get_sample_value("tenantgate_registry_refused_total", {"reason": reason, "source": source})
    return value or 0.0


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.fixture
async def registries(redis_server: RedisServer) -> AsyncIterator[tuple[Registry, Registry, GatewayMetrics, str]]:
    """Two gateways' registries on one Redis (their own prefix), the second's metrics, the prefix."""
    prefix = f"test-{uuid.uuid4().hex}"
    metrics = GatewayMetrics()
    a = Registry(redis_server.url, prefix=prefix, signing_key=KEY, resync_s=3600)
    b = Registry(redis_server.url, prefix=prefix, signing_key=KEY, resync_s=3600, metrics=metrics)
    await a.start(on_change=lambda: None)
    await b.start(on_change=lambda: None)
    yield a, b, metrics, prefix
    await a.close()
    await b.close()


async def test_forged_and_replayed_entries_are_refused(
    redis_server: RedisServer,
    registries: tuple[Registry, Registry, GatewayMetrics, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b, metrics, prefix = registries
    caplog.set_level(logging.ERROR, logger="gateway.tenants.registry")
    config = base_config()
    stolen = hash_key("a-key-someone-revoked")
    raw = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    channel, entries = f"{prefix}:registry", f"{prefix}:{{registry}}:entries"
    try:
        await a.change({"kind": "add_key", "tenant_id": "acme", "key_hash": stolen}, config)
        await until(lambda: b.state.keys.get(stolen) == "acme", "the key at b")
        add_key_envelope = await raw.hget(entries, f"key:{stolen}")  # what anyone reading Redis sees
        await a.change({"kind": "revoke_key", "key_hash": stolen}, config)
        await until(lambda: stolen in b.state.revoked, "the revocation at b")

        # Published: the add_key again (a replay), one unsigned (the old format), one signed with another key.
        assert add_key_envelope is not None
        await raw.publish(channel, add_key_envelope)
        await until(lambda: refused(metrics, "stale", "message") == 1, "the replay refused")
        intruder = hash_key("intruder")
        forged = {"kind": "add_key", "tenant_id": "globex", "key_hash": intruder}
        await raw.publish(channel, json.dumps(forged))
        await raw.publish(channel, json.dumps(Signer(b"a guessed key").envelope(forged, 99)))
        await until(lambda: refused(metrics, "forged", "message") == 2, "the forgeries refused")
        assert stolen in b.state.revoked and stolen not in b.state.keys  # was: the add_key applied again
        assert intruder not in b.state.keys
        assert any("refused a stale message entry" in r.getMessage() for r in caplog.records)
        assert any("refused a forged message entry" in r.getMessage() for r in caplog.records)

        # Stored: the old add_key written back over its revocation, and a forged entry beside it. A gateway that
        # starts now, and one that resyncs, believe neither; a change is refused until Redis is repaired.
        await raw.hset(entries, f"key:{stolen}", add_key_envelope)
        await raw.hset(entries, f"key:{intruder}", json.dumps(Signer(b"a guessed key").envelope(forged, 1)))
        fresh_metrics = GatewayMetrics()
        fresh = Registry(redis_server.url, prefix=prefix, signing_key=KEY, resync_s=3600, metrics=fresh_metrics)
        await fresh.start(on_change=lambda: None)
        try:
            assert stolen not in fresh.state.keys and intruder not in fresh.state.keys
            assert refused(fresh_metrics, "altered", "stored") == 1
        finally:
            await fresh.close()
        await b._resync()
        assert stolen in b.state.revoked and refused(metrics, "altered", "stored") == 1
        with pytest.raises(StoreUnavailable, match="altered"):
            await a.change({"kind": "add_key", "tenant_id": "acme", "key_hash": hash_key("new")}, config)
        # Put back as the gateways wrote it, the registry is believed again.
        await raw.hdel(entries, f"key:{intruder}")
        revoke = b.state.versions[f"key:{stolen}"]
        await raw.hset(
            entries,
            f"key:{stolen}",
            json.dumps(Signer(KEY).envelope({"kind": "revoke_key", "key_hash": stolen}, revoke)),
        )
        await a.change({"kind": "add_key", "tenant_id": "acme", "key_hash": hash_key("new")}, config)
        await until(lambda: hash_key("new") in b.state.keys, "a change after the repair")
    finally:
        await raw.aclose()


async def test_a_registry_key_of_another_type_is_refused_as_altered(
    redis_server: RedisServer,
    registries: tuple[Registry, Registry, GatewayMetrics, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Someone's SET over the entries hash (or a hash where the head belongs): the registry was read as unreachable
    (WRONGTYPE is a RedisError), logged at debug at every resync, counted nowhere. It is an alteration: refused,
    counted and logged as one, the gateway keeps what it applied, and a change is refused until Redis is repaired."""
    a, b, metrics, prefix = registries
    caplog.set_level(logging.ERROR, logger="gateway.tenants.registry")
    config = base_config()
    kept = hash_key("a-key-added-before")
    await a.change({"kind": "add_key", "tenant_id": "acme", "key_hash": kept}, config)
    await until(lambda: b.state.keys.get(kept) == "acme", "the key at b")
    raw = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    entries, head = f"{prefix}:{{registry}}:entries", f"{prefix}:{{registry}}:head"
    try:
        saved_entries = {str(field): str(value) for field, value in (await raw.hgetall(entries)).items()}
        saved_head = await raw.get(head)
        assert saved_head is not None
        for key, wrong in ((entries, "set"), (head, "hset")):
            await raw.delete(key)
            await (raw.set(key, "x") if wrong == "set" else raw.hset(key, "x", "y"))
            before = refused(metrics, "altered", "stored")
            await b._resync()
            assert refused(metrics, "altered", "stored") == before + 1
            assert b.state.keys.get(kept) == "acme"  # what it applied stays
            assert any(f"{key} holds a" in r.getMessage() for r in caplog.records)
            with pytest.raises(StoreUnavailable, match="altered"):
                await a.change({"kind": "add_key", "tenant_id": "acme", "key_hash": hash_key("new")}, config)
            await raw.delete(key)
            if key == entries:
                for field, value in saved_entries.items():
                    await raw.hset(entries, field, value)
            else:
                await raw.set(head, saved_head)
        # Put back, the registry is believed again.
        await a.change({"kind": "add_key", "tenant_id": "acme", "key_hash": hash_key("after")}, config)
        await until(lambda: b.state.keys.get(hash_key("after")) == "acme", "a change after the repair")
    finally:
        await raw.aclose()


async def test_an_older_registry_put_back_whole_is_refused(
    redis_server: RedisServer, registries: tuple[Registry, Registry, GatewayMetrics, str]
) -> None:
    """Entries and head copied away and written back later (consistent, signed, but old): a gateway that has
    applied newer changes refuses it."""
    a, b, metrics, prefix = registries
    config = base_config()
    raw = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    entries, head = f"{prefix}:{{registry}}:entries", f"{prefix}:{{registry}}:head"
    key = hash_key("revoked-later")
    try:
        await a.change({"kind": "add_key", "tenant_id": "acme", "key_hash": key}, config)
        saved_entries = {str(field): str(value) for field, value in (await raw.hgetall(entries)).items()}
        saved_head = await raw.get(head)
        assert saved_head is not None
        await a.change({"kind": "revoke_key", "key_hash": key}, config)
        await until(lambda: key in b.state.revoked, "the revocation at b")
        await raw.delete(entries)
        await raw.hset(entries, mapping=dict(saved_entries.items()))
        assert saved_head is not None
        await raw.set(head, saved_head)
        await b._resync()
        assert key in b.state.revoked and key not in b.state.keys
        assert refused(metrics, "stale", "stored") == 1
    finally:
        await raw.aclose()


def test_a_published_forged_key_does_not_work(tmp_path: Path, redis_server: RedisServer) -> None:
    """A gateway process on a real redis-server: a PUBLISH of an add_key for globex, as anyone who reaches Redis
    can send it, adds no working key (the openai SDK gets 401; before, 200) and is logged and counted."""
    adapters = write_adapters(tmp_path, ["support-acme", "sql-globex"])
    extra = {"state": {"redis_url": redis_server.url}}
    intruder_key = f"intruder-{uuid.uuid4().hex}"
    forged = {"kind": "add_key", "tenant_id": "globex", "key_hash": hash_key(intruder_key)}
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with simulated_replicas(tmp_path, 1, "--time-scale", "0") as urls:
        config = gateway_config(urls, TENANTS, adapters, port=free_port(), extra=extra)
        with gateway_process(tmp_path, config) as (url, _):

            async def publish() -> None:
                raw = redis.asyncio.Redis.from_url(redis_server.url)
                try:
                    await raw.publish("tg:registry", json.dumps(forged))
                    envelope = Signer(derived_key("not-the-admin-token")).envelope(forged, 10**9)
                    await raw.publish("tg:registry", json.dumps(envelope))
                finally:
                    await raw.aclose()

            asyncio.run(publish())
            deadline = time.monotonic() + 10
            pattern = 'tenantgate_registry_refused_total{reason="forged",source="message"} 2.0'
            while pattern not in httpx.get(url + "/metrics", headers=admin, timeout=10).text:
                assert time.monotonic() < deadline, "the gateway did not refuse both messages"
                time.sleep(0.05)
            client = openai.OpenAI(base_url=url + "/v1", api_key=intruder_key, max_retries=0, timeout=30)
            with pytest.raises(openai.AuthenticationError):
                client.completions.create(model="sql-globex", prompt="hello", max_tokens=2)
            legit = openai.OpenAI(base_url=url + "/v1", api_key=api_key("globex"), max_retries=0, timeout=30)
            assert legit.completions.create(model="sql-globex", prompt="hello", max_tokens=2).choices
        log = (tmp_path / "gateway.log").read_text()
        assert "refused a forged message entry" in log


async def test_a_change_whose_message_was_lost_arrives_at_the_next_resync(redis_server: RedisServer) -> None:
    """README, Identity: every gateway applies a change as soon as it is published, and a resync every 5 s repairs a
    missed one. Here b hears nothing (its messages are lost, as pub/sub may lose them) and resyncs every 0.2 s."""
    assert inspect.signature(Registry).parameters["resync_s"].default == 5.0  # what the app builds it with
    prefix = f"test-{uuid.uuid4().hex}"
    a = Registry(redis_server.url, prefix=prefix, signing_key=KEY, resync_s=3600)
    b = Registry(redis_server.url, prefix=prefix, signing_key=KEY, resync_s=0.2)
    heard: list[str | bytes] = []
    b._message = heard.append  # type: ignore[method-assign,assignment]  # the message is lost on its way to b
    await a.start(on_change=lambda: None)
    await b.start(on_change=lambda: None)
    raw = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        for _ in range(500):  # a bounded poll: both follow the channel (else b's start-up resync could bring it)
            [(_, listening)] = await raw.pubsub_numsub(f"{prefix}:registry")
            if listening == 2:
                break
            await asyncio.sleep(0.01)
        added = hash_key("a-key-added-while-b-was-deaf")
        await a.change({"kind": "add_key", "tenant_id": "acme", "key_hash": added}, base_config())
        await until(lambda: b.state.keys.get(added) == "acme", "the key at b by its resync")
        await until(lambda: bool(heard), "the message, lost at b")  # it was published: b took it from Redis
    finally:
        await raw.aclose()
        await a.close()
        await b.close()


@pytest.mark.parametrize(
    "newer",
    [
        pytest.param(
            {
                "kind": "add_tenant",
                "tenant_id": "initech",
                "tenant": {"id": "initech", "api_keys": [hash_key("initech-key")], "adapters": [], "a_newer_field": 1},
            },
            id="a field this schema forbids",
        ),
        pytest.param(
            {"kind": "add_tenant", "tenant_id": "initech", "config": {"id": "initech"}}, id="tenant under another name"
        ),
        pytest.param({"kind": "add_key", "key_hash": hash_key("initech-key"), "tenant": "initech"}, id="key's tenant"),
        pytest.param({"kind": "add_key", "key_hash": [hash_key("initech-key")], "tenant_id": "initech"}, id="key list"),
        pytest.param({"kind": "add_key", "key_hash": hash_key("initech-key"), "tenant_id": ["initech"]}, id="tenants"),
    ],
)
async def test_a_stored_entry_of_another_versions_schema_is_refused_alone(
    redis_server: RedisServer, newer: dict[str, Any]
) -> None:
    """A signed entry of a kind this version knows in a shape it cannot apply (a tenant with a field a newer gateway
    has, tenants being validated with extra fields forbidden; a field under another name; a list where this version
    has a string) is refused and counted, stored or published, and every other entry still applies. Its
    ValidationError, KeyError or TypeError went past the resync's handling: out of Registry.start, which a gateway
    runs at start-up (no gateway of this version could start while the entry was there), and out of every resync of
    a running one, so its subscription, which resyncs first, fell over every second and it applied no change from
    then on (a447658's known_entity checks only what names the entity, f363687 caught only ValidationError)."""
    prefix = f"test-{uuid.uuid4().hex}"
    writer = Registry(redis_server.url, prefix=prefix, signing_key=KEY, resync_s=3600)  # stores only: not started
    revoked = hash_key(api_key("globex"))
    try:
        await writer._store({"kind": "add_key", "tenant_id": "globex", "key_hash": hash_key("second")})
        stored = await writer._store(newer)  # as a newer gateway would
        await writer._store({"kind": "revoke_key", "key_hash": revoked})
    finally:
        await writer.close()
    metrics = GatewayMetrics()
    fresh = Registry(redis_server.url, prefix=prefix, signing_key=KEY, resync_s=3600, metrics=metrics)
    await fresh.start(on_change=lambda: None)
    try:
        assert revoked in fresh.state.revoked and fresh.state.keys.get(hash_key("second")) == "globex"
        assert "initech" not in fresh.state.tenants and hash_key("initech-key") not in fresh.state.keys
        assert refused(metrics, "invalid", "stored") >= 1  # counted at every resync it is read again
        fresh.state.merged(base_config(), lenient=True)  # what the gateway serves: a tenant list raised TypeError
        await fresh._resync()  # and again at every resync, without raising
        assert revoked in fresh.state.revoked
        fresh._message(json.dumps(Signer(KEY).envelope(newer, stored + 10)))  # published: refused alone too
        assert refused(metrics, "invalid", "message") == 1
        assert "initech" not in fresh.state.tenants and hash_key("initech-key") not in fresh.state.keys
    finally:
        await fresh.close()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"kind": "set_quota", "quota": {"tenant": "acme", "gpu_s": 5}}, id="a kind this version lacks"),
        pytest.param({"kind": "add_key", "tenant_id": "acme", "key": "k"}, id="a known kind, another shape"),
    ],
)
async def test_a_signed_entry_of_a_kind_or_shape_this_version_lacks_is_refused_alone(
    redis_server: RedisServer, change: dict[str, Any]
) -> None:
    """A newer gateway (same signing key) stores and publishes a change of a kind this version does not know, or a
    known kind in another shape. It is refused alone (invalid) and everything else applies: it was taken for an
    altered registry before, so a gateway of this version (re)started with none of the run-time entries (a key
    revoked at run time worked on it again), refused every resync, and could make no change; the message raised
    KeyError out of the subscription (another shape) or was counted forged."""
    prefix = f"test-{uuid.uuid4().hex}"
    # Neither follows the channel (start's tasks): what is tested is start's first step, the resync, and a change.
    writer = Registry(redis_server.url, prefix=prefix, signing_key=KEY, resync_s=3600)
    raw = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=True)
    revoked = hash_key(api_key("globex"))
    signer = Signer(KEY)
    try:
        await writer._store({"kind": "add_key", "tenant_id": "globex", "key_hash": hash_key("second")})
        await writer._store({"kind": "revoke_key", "key_hash": revoked})
        async with writer._locked():  # what a newer gateway's _store does
            head_version, _, versions = await writer._snapshot()
            versions["quota:acme"] = head_version + 1
            envelope = json.dumps(signer.envelope(change, head_version + 1))
            await raw.hset(f"{prefix}:{{registry}}:entries", "quota:acme", envelope)
            await raw.set(f"{prefix}:{{registry}}:head", json.dumps(signer.head(head_version + 1, versions)))
        metrics = GatewayMetrics()
        fresh = Registry(redis_server.url, prefix=prefix, signing_key=KEY, resync_s=3600, metrics=metrics)
        fresh._on_change = lambda: None
        await fresh._resync()  # what start does first
        try:
            assert revoked in fresh.state.revoked and fresh.state.keys.get(hash_key("second")) == "globex"
            assert refused(metrics, "invalid", "stored") >= 1 and refused(metrics, "altered", "stored") == 0
            fresh._message(envelope)  # published too: refused alone, nothing raised
            assert refused(metrics, "invalid", "message") == 1
            added = hash_key("third")
            await fresh.change({"kind": "add_key", "tenant_id": "globex", "key_hash": added}, base_config())
            await writer._resync()
            assert writer.state.keys.get(added) == "globex"
        finally:
            await fresh.close()
    finally:
        await raw.aclose()
        await writer.close()
