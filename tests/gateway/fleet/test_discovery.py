"""Replicas from DNS: resolved from a local DNS server the test controls; replicas that appear and disappear
there change the ring as a config change would."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import DiscoveryConfig, GatewayConfig
from gateway.fleet.discovery import discover, resolve, with_replicas
from gateway.routing.ring import Ring
from loadtests.faultkit import GatewayUnderTest, sim_replicas
from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config, write_adapters
from loadtests.processes import free_port
from tests.dns_stub import DnsStub

pytestmark = pytest.mark.timeout(120)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def publish(stub: DnsStub, replicas: dict[str, str]) -> None:
    """SRV records for the replicas (name -> url on 127.0.0.1), as a headless Service would have."""
    stub.srv["sims.test"] = [(f"{name}.sims.test", int(url.rsplit(":", 1)[1])) for name, url in replicas.items()]
    for name in replicas:
        stub.a[f"{name}.sims.test"] = ["127.0.0.1"]


def test_srv_and_a_records_become_replicas() -> None:
    with DnsStub() as stub:
        publish(stub, {"vllm-1": "http://127.0.0.1:9002", "vllm-0": "http://127.0.0.1:9001"})
        stub.a["pods.test"] = ["127.0.0.2", "127.0.0.3"]
        by_srv = asyncio.run(resolve(DiscoveryConfig(name="sims.test", nameservers=[stub.nameserver])))
        by_a = asyncio.run(
            resolve(DiscoveryConfig(name="pods.test", record="A", port=8000, nameservers=[stub.nameserver]))
        )
    assert [(r.id, str(r.url)) for r in by_srv] == [
        ("vllm-0", "http://127.0.0.1:9001/"),
        ("vllm-1", "http://127.0.0.1:9002/"),
    ]
    assert [(r.id, str(r.url)) for r in by_a] == [
        ("127.0.0.2", "http://127.0.0.2:8000/"),
        ("127.0.0.3", "http://127.0.0.3:8000/"),
    ]


def test_a_failed_lookup_keeps_the_replicas_known() -> None:
    with DnsStub() as stub:
        config = GatewayConfig.model_validate(
            {
                "pools": [{"name": "p", "backend": "vllm", "base_model": "m",
                           "discovery": {"name": "gone.test", "nameservers": [stub.nameserver]}}],
                "tenants": [{"id": "t", "api_keys": ["sha256:" + "0" * 64], "base_models": ["m"]}],
            }
        )  # fmt: skip
        known = {"p": list(with_replicas(config, {"p": []}).pools[0].replicas)}
        publish(stub, {"r0": "http://127.0.0.1:9001"})
        stub.srv["gone.test"] = stub.srv.pop("sims.test")
        found = asyncio.run(discover(config, known))
        assert [r.id for r in found["p"]] == ["r0"]
        stub.srv.clear()  # NXDOMAIN now: keep what was known
        assert asyncio.run(discover(config, found)) == found


@pytest.mark.parametrize("placement", ["ring", "balanced"])
def test_replicas_appearing_and_disappearing_in_dns_change_homes_as_a_config_change_would(
    tmp_path: Path, placement: str
) -> None:
    tenants = {f"t{i}": [f"lora-t{i}"] for i in range(12)}
    adapters = write_adapters(tmp_path, [names[0] for names in tenants.values()])
    with sim_replicas(tmp_path, 4, "--time-scale", "0", "--max-loras", "8") as sims, DnsStub() as stub:
        urls = {name: sim.url for name, sim in sims.items()}
        publish(stub, {name: urls[name] for name in ("r0", "r1", "r2")})
        config: dict[str, Any] = gateway_config({}, tenants, adapters, port=free_port(), max_adapters=12)
        config["routing"]["home_placement"] = placement
        config["pools"][0]["discovery"] = {"name": "sims.test", "nameservers": [stub.nameserver], "interval_s": 0.3}
        gateway = GatewayUnderTest(tmp_path, config)
        gateway.start()
        try:
            before = {t: gateway.home_of(t) for t in tenants}
            assert set(before.values()) <= {"r0", "r1", "r2"}
            publish(stub, {name: urls[name] for name in ("r0", "r1", "r3")})
            del stub.a["r2.sims.test"]
            for _ in range(200):  # bounded: until the gateway has re-resolved and rebuilt
                replicas = httpx.get(gateway.url + "/admin/residency", headers=ADMIN).json()["pools"]["llama"][
                    "replicas"
                ]
                if set(replicas) == {"r0", "r1", "r3"}:
                    break
                time.sleep(0.05)
            assert set(replicas) == {"r0", "r1", "r3"}
            after = {t: gateway.home_of(t) for t in tenants}
            moved_to_r3 = [t for t in tenants if after[t] == "r3"]
            for tenant in moved_to_r3[:1]:
                body = {"model": tenants[tenant][0], "prompt": "x", "max_tokens": 2}
                served = sims["r3"].stats()["requests_by_model"].get(tenants[tenant][0], 0)  # the fill's warm-up
                answer = httpx.post(gateway.url + "/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {api_key(tenant)}"})  # fmt: skip
                assert answer.status_code == 200
                assert sims["r3"].stats()["requests_by_model"].get(tenants[tenant][0]) == served + 1
        finally:
            gateway.stop()
    assert moved_to_r3
    # The homes a config file listing r0, r1, r3 gives.
    listed = Ring(["r0", "r1", "r3"], vnodes=160)
    listed.balance(tenants if placement == "balanced" else ())
    assert after == {t: listed.home(t) for t in tenants}
    if placement == "ring":  # and with ring homes, only the tenants of the replicas that left or came move
        moved = {t for t in tenants if before[t] != after[t]}
        assert moved == {t for t in tenants if before[t] == "r2" or after[t] == "r3"}


def test_a_relative_name_resolves_in_the_namespace_the_search_list_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifests name `_http._tcp.vllm`, no namespace: a pod's resolv.conf (Kubernetes writes it with its own
    namespace first in the search list, ndots:5) makes it the Service of the namespace kustomize put it in."""
    resolv_conf = tmp_path / "resolv.conf"
    resolv_conf.write_text(
        "nameserver 127.0.0.1\nsearch tenants.svc.cluster.local svc.cluster.local cluster.local\noptions ndots:5\n"
    )
    monkeypatch.setattr("gateway.fleet.discovery.RESOLV_CONF", str(resolv_conf))
    with DnsStub() as stub:
        stub.srv["_http._tcp.vllm.tenants.svc.cluster.local"] = [("vllm-0.vllm.tenants.svc.cluster.local", 8000)]
        stub.a["vllm-0.vllm.tenants.svc.cluster.local"] = ["127.0.0.9"]
        found = asyncio.run(resolve(DiscoveryConfig(name="_http._tcp.vllm", nameservers=[stub.nameserver])))
    assert [(r.id, str(r.url)) for r in found] == [("vllm-0", "http://127.0.0.9:8000/")]
