"""Prefix-cache isolation (issue 20, "Shared-state and operator surfaces"): tenants on one base model could time
each other's prompts through the engine's shared prefix cache. A request for a model another tenant can also call
carries its tenant's own cache_salt (vLLM pools, on by default); a client cannot send one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.registry import EngineSpec, NoSettings, register
from gateway.config import GatewayConfig
from gateway.errors import InvalidRequest
from gateway.serving.openai_request import parse_inference
from gateway.tenants.directory import TenantDirectory, cache_salt
from loadtests.fleet import BASE_MODEL, api_key, gateway_config, gateway_process, simulated_replicas, write_adapters
from loadtests.processes import free_port
from tests.gateway.residency.fakes import FakeDriver, FakeEngine

pytestmark = pytest.mark.timeout(120)
# An engine that takes no salt (as Triton).
register(EngineSpec("saltless-fake", NoSettings, lambda settings, pool: FakeDriver(FakeEngine())))


def config(**pool: Any) -> GatewayConfig:
    adapters = {"support-acme": "/srv/a", "sql-globex": "/srv/b", "shared-faq": "/srv/c", "faq-v2": "/srv/d"}
    tenants = {"acme": ["support-acme", "shared-faq", "faq"], "globex": ["sql-globex", "shared-faq"]}
    raw = gateway_config({"r0": "http://127.0.0.1:1"}, tenants, adapters, port=0)
    raw["pools"][0].update(pool)
    # acme's split: shared-faq (which globex calls too) or faq-v2 (acme's alone).
    raw["splits"] = [
        {"name": "faq", "variants": [{"model": "shared-faq", "weight": 1}, {"model": "faq-v2", "weight": 1}]}
    ]
    return GatewayConfig.model_validate(raw)


def test_a_model_two_tenants_call_is_salted_per_tenant() -> None:
    directory = TenantDirectory(config())
    acme, globex = directory.by_id["acme"], directory.by_id["globex"]
    assert acme.targets[BASE_MODEL].cache_salt == cache_salt("acme")  # was None: one shared prefix cache
    assert globex.targets[BASE_MODEL].cache_salt == cache_salt("globex") != cache_salt("acme")
    assert acme.targets["shared-faq"].cache_salt == cache_salt("acme")
    assert globex.targets["shared-faq"].cache_salt == cache_salt("globex")
    # A model only one tenant calls keeps its plain cache (vLLM keys it by the adapter already).
    assert acme.targets["support-acme"].cache_salt is None and globex.targets["sql-globex"].cache_salt is None
    # A split: each variant as what it runs on.
    variants = {variant.model: variant.cache_salt for _, variant in acme.targets["faq"].variants}
    assert variants == {"shared-faq": cache_salt("acme"), "faq-v2": None}
    assert "acme" not in cache_salt("acme")  # engines log it: not the tenant's id


def test_no_salt_where_the_pool_shares_or_the_engine_takes_none() -> None:
    assert TenantDirectory(config(cache_salt=False)).by_id["acme"].targets[BASE_MODEL].cache_salt is None
    saltless = config(backend="saltless-fake")
    assert not saltless.pools[0].salts_prefix_cache
    assert TenantDirectory(saltless).by_id["acme"].targets[BASE_MODEL].cache_salt is None


def test_the_engine_gets_the_salt_and_a_client_cannot_send_one() -> None:
    request = parse_inference(b'{"model": "m", "prompt": "hi"}', "completions")
    assert json.loads(request.for_engine("llama", cache_salt="s1"))["cache_salt"] == "s1"
    assert "cache_salt" not in json.loads(request.for_engine("llama"))
    with pytest.raises(InvalidRequest, match="cache_salt"):
        parse_inference(b'{"model": "m", "prompt": "hi", "cache_salt": "guess"}', "completions")


def test_one_tenant_never_hits_a_prefix_another_cached(tmp_path: Path) -> None:
    """Through a gateway process to a simulated vLLM replica (whose prefix cache keys blocks by adapter and
    cache_salt, as vLLM's): acme and globex send one long prompt to the base model they share. globex's request finds
    nothing cached (before: acme's whole prompt, which is what made its latency tell); acme's second finds its own."""
    adapters = write_adapters(tmp_path, ["support-acme", "sql-globex"])
    prompt = " ".join(f"secret{i}" for i in range(400))
    with simulated_replicas(tmp_path, 1, "--time-scale", "0") as urls:
        gateway = gateway_config(urls, {"acme": ["support-acme"], "globex": ["sql-globex"]}, adapters, port=free_port())
        with gateway_process(tmp_path, gateway) as (url, _):
            replica = next(iter(urls.values()))

            def hit_tokens_after(tenant: str) -> int:
                before = httpx.get(replica + "/sim/stats").json()["prefix_hit_tokens"]
                body = {"model": BASE_MODEL, "prompt": prompt, "max_tokens": 2}
                answer = httpx.post(
                    url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {api_key(tenant)}"}
                )
                assert answer.status_code == 200, answer.text
                hits: int = httpx.get(replica + "/sim/stats").json()["prefix_hit_tokens"] - before
                return hits

            assert hit_tokens_after("acme") == 0
            assert hit_tokens_after("globex") == 0  # was 1,088: acme's whole prompt, cached
            assert hit_tokens_after("acme") >= 384  # its own prefix, whole blocks of 16
            assert hit_tokens_after("globex") >= 384
