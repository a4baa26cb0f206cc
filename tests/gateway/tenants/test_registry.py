"""Tenants and keys at run time: the registry's rules, trusted-header identity, and two gateways sharing Redis
where a key revoked through one is refused by the other as soon as the change's message arrives."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import httpx
import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.config import AuthConfig, ConfigError, GatewayConfig
from gateway.errors import AuthenticationFailed, InvalidRequest
from gateway.tenants.directory import TenantDirectory
from gateway.tenants.identity import authenticate, hash_key, identify
from gateway.tenants.registry import Registry, RegistryState
from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config, gateway_process, simulated_replicas, write_adapters
from loadtests.processes import free_port

pytestmark = pytest.mark.timeout(120)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
TENANTS = {"acme": ["support-acme"], "globex": ["sql-globex"]}


def base_config() -> GatewayConfig:
    adapters = {"support-acme": "/srv/a", "sql-globex": "/srv/b"}
    return GatewayConfig.model_validate(gateway_config({"r0": "http://127.0.0.1:1"}, TENANTS, adapters, port=0))


def test_keys_added_and_revoked_merge_over_the_config() -> None:
    state = RegistryState()
    state.apply({"kind": "add_key", "tenant_id": "acme", "key_hash": hash_key("new-acme-key")})
    state.apply({"kind": "revoke_key", "key_hash": hash_key(api_key("acme"))})  # a config key
    directory = TenantDirectory(state.merged(base_config()))
    assert authenticate(directory, "Bearer new-acme-key").id == "acme"
    with pytest.raises(AuthenticationFailed):
        authenticate(directory, f"Bearer {api_key('acme')}")


def test_a_retired_adapter_leaves_the_catalog_and_every_tenant() -> None:
    state = RegistryState()
    state.apply({"kind": "add_adapter", "adapter": {"name": "support-acme-v2", "pool": "llama", "source": "/srv/v2"}})
    state.apply({"kind": "retire_adapter", "name": "support-acme"})
    config = state.merged(base_config())
    assert {a.name for a in config.adapters} == {"support-acme-v2", "sql-globex"}
    acme = next(t for t in config.tenants if t.id == "acme")
    assert acme.adapters == []  # its only adapter retired: acme keeps its base model


async def test_a_change_keeps_the_run_time_splits() -> None:
    registry = Registry(None)
    split = {"name": "support@ab", "variants": [{"model": "support-acme", "weight": 1}]}
    await registry.change({"kind": "set_split", "split": split}, base_config())
    merged = await registry.change({"kind": "add_key", "tenant_id": "acme", "key_hash": hash_key("k2")}, base_config())
    assert [s.name for s in merged.splits] == ["support@ab"]
    assert "support@ab" in registry.state.splits


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"kind": "add_tenant", "tenant_id": "initech"}, id="no tenant: KeyError"),
        pytest.param({"kind": "add_key", "tenant_id": "acme", "key_hash": ["sha256:" + "0" * 64]}, id="TypeError"),
        pytest.param({"kind": "set_split"}, id="no split: KeyError"),
        pytest.param({"kind": "rename_tenant", "tenant_id": "acme"}, id="unknown kind: Refused"),
        pytest.param({"tenant_id": "acme"}, id="no kind: KeyError"),
    ],
)
async def test_a_change_that_fails_to_apply_in_any_way_is_refused_as_a_config_error(change: dict[str, object]) -> None:
    """Registry.change caught only pydantic's ValidationError from apply: a change missing its body (KeyError) or
    naming a key by a list (TypeError) went past it, and the admin API answered 500 instead of the 400 of any
    refused change. The registry is left as it was."""
    registry = Registry(None)
    with pytest.raises(ConfigError, match="tenant"):
        await registry.change(change, base_config())
    assert registry.state.version == 0 and not registry.state.keys and not registry.state.tenants


def test_a_bad_tenant_is_refused_whole() -> None:
    state = RegistryState()
    state.apply({"kind": "add_tenant", "tenant": {"id": "initech", "api_keys": [hash_key("k")], "adapters": ["nope"]}})
    with pytest.raises(ConfigError, match="unknown adapter"):
        state.merged(base_config())


@pytest.mark.parametrize(
    "theirs",
    [
        pytest.param(
            {"kind": "add_adapter", "adapter": {"name": "m", "pool": "mistral", "source": "/srv/m"}}, id="adapter"
        ),
        pytest.param(
            {"kind": "set_split", "split": {"name": "s@ab", "variants": [{"model": "m", "weight": 1}]}}, id="split"
        ),
        pytest.param(  # the engine name of an adapter this config has (another config: another adapter)
            {
                "kind": "add_adapter",
                "adapter": {"name": "m", "pool": "llama", "source": "/m", "engine_name": "sql-globex"},
            },
            id="engine name",
        ),
    ],
)
def test_a_change_only_another_config_can_serve_leaves_the_others_applied(theirs: dict[str, object]) -> None:
    """Gateways with different configs share the registry: one whose config has a pool "mistral" adds an adapter
    there (or a split over it, or an adapter whose engine name is another adapter's here). This gateway leaves that
    out and logs it, and still applies every other change:
    the whole merge failed before, so refresh_tenants applied nothing from then on, and a key revoked through the
    other gateway (a leaked one) went on working here."""
    state = RegistryState()
    state.apply({"kind": "add_key", "tenant_id": "acme", "key_hash": hash_key("second-acme-key")})
    state.apply(theirs)
    state.apply({"kind": "revoke_key", "key_hash": hash_key(api_key("acme"))})
    config = state.merged(base_config(), lenient=True)
    directory = TenantDirectory(config)
    with pytest.raises(AuthenticationFailed):
        authenticate(directory, f"Bearer {api_key('acme')}")
    assert authenticate(directory, "Bearer second-acme-key").id == "acme"
    assert "m" not in {a.name for a in config.adapters} and not config.splits
    with pytest.raises(ConfigError):
        state.merged(base_config())  # what an admin change through this gateway is checked against: refused


def test_the_trusted_header_counts_only_from_trusted_networks() -> None:
    directory = TenantDirectory(base_config())
    auth = AuthConfig.model_validate({"trusted_header": "X-Tenant-ID", "trusted_networks": ["10.0.0.0/8"]})
    assert identify(directory, {"X-Tenant-ID": "globex"}, "10.1.2.3", auth).id == "globex"
    with pytest.raises(AuthenticationFailed):  # from elsewhere the header is ignored: a key is needed
        identify(directory, {"X-Tenant-ID": "globex"}, "192.168.1.1", auth)
    assert identify(directory, {"X-Tenant-ID": "globex", "Authorization": f"Bearer {api_key('acme')}"},
                              "192.168.1.1", auth).id == "acme"  # fmt: skip
    off = AuthConfig()
    with pytest.raises(AuthenticationFailed):
        identify(directory, {"X-Tenant-ID": "globex"}, "10.1.2.3", off)
    with pytest.raises(ValueError, match="trusted_networks"):
        AuthConfig.model_validate({"trusted_header": "X-Tenant-ID"})


def test_the_trusted_header_and_a_key_must_agree_and_the_header_comes_once() -> None:
    directory = TenantDirectory(base_config())
    auth = AuthConfig.model_validate({"trusted_header": "X-Tenant-ID", "trusted_networks": ["10.0.0.0/8"]})
    both = {"X-Tenant-ID": "globex", "Authorization": f"Bearer {api_key('acme')}"}
    with pytest.raises(AuthenticationFailed, match="different tenants"):  # was: globex, on acme's key
        identify(directory, both, "10.1.2.3", auth)
    # A credential that is no tenant's key (an ingress's own token passed through) says nothing: the header decides.
    assert identify(directory, {**both, "Authorization": "Bearer an-oauth-token"}, "10.1.2.3", auth).id == "globex"
    agreeing = {"X-Tenant-ID": "acme", "Authorization": f"Bearer {api_key('acme')}"}
    assert identify(directory, agreeing, "10.1.2.3", auth).id == "acme"
    repeated = CIMultiDictProxy(CIMultiDict([("X-Tenant-ID", "acme"), ("X-Tenant-ID", "globex")]))
    with pytest.raises(InvalidRequest, match="repeated"):  # was: the first value, acme
        identify(directory, repeated, "10.1.2.3", auth)
    with pytest.raises(AuthenticationFailed):  # from elsewhere the header, repeated or not, is ignored
        identify(directory, repeated, "192.168.1.1", auth)


def completion(gateway: str, key: str, model: str) -> int:
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    return httpx.post(gateway + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}).status_code


def answers(gateway: str, key: str, model: str, status: int) -> bool:
    """Whether the gateway answers ``status`` once a change published at another gateway reaches it: pub/sub
    delivers within milliseconds, not before the publisher's own answer, so poll. The bound stays under the
    registry's 5 s resync, which would otherwise deliver the change even with pub/sub broken."""
    deadline = time.monotonic() + 2
    while (seen := completion(gateway, key, model)) != status and time.monotonic() < deadline:
        time.sleep(0.02)
    return seen == status


@pytest.mark.parametrize("kind", ["redis", "cluster"])
def test_changes_through_one_gateway_take_effect_at_another(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    server = request.getfixturevalue("redis_cluster" if kind == "cluster" else "redis_server")
    adapters = write_adapters(tmp_path, ["support-acme", "sql-globex"])
    extra = {"state": {"redis_url": server.url, "cluster": kind == "cluster"}}
    with simulated_replicas(tmp_path, 1, "--time-scale", "0") as urls, contextlib.ExitStack() as stack:
        a, b = (
            stack.enter_context(gateway_process(tmp_path, gateway_config(urls, TENANTS, adapters, port=free_port(),
                                                                           extra=extra), name))[0]
            for name in ("gw-a", "gw-b")
        )  # fmt: skip
        # A new tenant, added through A, calls through B.
        tenant = {"id": "initech", "api_keys": [hash_key("initech-key")], "adapters": ["sql-globex"]}
        assert httpx.post(a + "/admin/tenants", json=tenant, headers=ADMIN).status_code == 200
        assert answers(b, "initech-key", "sql-globex", 200)
        # A key added to a config tenant through B works at A; revoked through A, B refuses it next.
        rotated = "rotated-acme-key-0123456789abcdefgh"  # admin.min_api_key_chars: 32
        added = httpx.post(b + "/admin/tenants/acme/keys", json={"api_key": rotated}, headers=ADMIN)
        assert added.status_code == 200 and rotated not in added.text
        assert answers(a, rotated, "support-acme", 200)
        revoked = httpx.delete(a + f"/admin/keys/{hash_key(rotated)}", headers=ADMIN)
        assert revoked.status_code == 200
        assert answers(b, rotated, "support-acme", 401)
        assert completion(b, api_key("acme"), "support-acme") == 200  # the config's own key still works
        # A change that does not validate is refused whole.
        bad = httpx.post(a + "/admin/tenants", json={"id": "x", "api_keys": ["plain"], "adapters": []}, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        assert "api_keys" in bad.json()["error"]["message"]
        # Removing the run-time tenant: gone everywhere.
        assert httpx.delete(a + "/admin/tenants/initech", headers=ADMIN).status_code == 200
        assert answers(b, "initech-key", "sql-globex", 401)
        refused = httpx.delete(a + "/admin/tenants/acme", headers=ADMIN)  # from the config file
        assert refused.status_code == 400

        # An adapter and a tenant for it, added through A, serve through B; retired through B, both answer 404.
        # (A tenant left with nothing to call is refused: the retire would fail whole.)
        source = write_adapters(tmp_path, ["summarize-hooli"])["summarize-hooli"]  # beside the file's adapters
        adapter = {"name": "summarize-hooli", "pool": "llama", "source": source}
        assert httpx.post(a + "/admin/catalog/adapters", json=adapter, headers=ADMIN).status_code == 200
        hooli = {"id": "hooli", "api_keys": [hash_key("hooli-key")], "adapters": ["summarize-hooli"],
                 "base_models": ["tiny-llama"]}  # fmt: skip
        assert httpx.post(a + "/admin/tenants", json=hooli, headers=ADMIN).status_code == 200
        assert answers(b, "hooli-key", "summarize-hooli", 200)
        assert httpx.delete(b + "/admin/catalog/adapters/summarize-hooli", headers=ADMIN).status_code == 200
        assert answers(a, "hooli-key", "summarize-hooli", 404)
        assert completion(b, "hooli-key", "summarize-hooli") == 404
