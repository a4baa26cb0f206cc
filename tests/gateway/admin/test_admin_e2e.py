"""Operator claims checked in a running gateway (tenantgate serve) against simulated replicas, each test with its own
fleet: a drain through the admin API, the admin API off without a token, run-time tenants surviving a reload, and
a client's headers (its API key included) never reaching an engine. What the engines saw is read from the
simulators' own counters and records."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtests.faultkit import GatewayUnderTest, SimReplica, sim_replicas
from loadtests.fleet import ADMIN_TOKEN, BASE_MODEL, api_key, gateway_config, write_adapters
from loadtests.processes import free_port

pytestmark = pytest.mark.timeout(120)

SIM = ["--time-scale", "0.01", "--max-loras", "4", "--max-cpu-loras", "8"]
TENANTS = {"t0": ["lora-t0"], "t1": ["lora-t1"]}


def config_for(root: Path, replicas: dict[str, SimReplica]) -> dict[str, Any]:
    adapters = write_adapters(root, ["lora-t0", "lora-t1"])
    urls = {name: replica.url for name, replica in replicas.items()}
    # bounded_consistent_hash: a request goes to its tenant's home unless the claim under test moves it.
    config = gateway_config(urls, TENANTS, adapters, port=free_port(), max_adapters=8, policy="bounded_consistent_hash")
    config["pools"][0]["slow_start_s"] = 0
    return config


def gateway(root: Path, config: dict[str, Any], *, admin_token: bool = True) -> GatewayUnderTest:
    process = GatewayUnderTest(root, config)
    if not admin_token:
        process.env = {}  # TENANTGATE_ADMIN_TOKEN unset
    return process


def complete(gw: GatewayUnderTest, tenant: str, model: str) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=api_key(tenant), max_retries=0, timeout=30)
    assert client.completions.create(model=model, prompt="x", max_tokens=2).choices


def served(replicas: dict[str, SimReplica], model: str) -> dict[str, int]:
    return {name: r.stats()["requests_by_model"].get(model, 0) for name, r in replicas.items()}


def test_a_drain_through_the_admin_api_moves_traffic_off_the_replica_and_an_undrain_brings_it_back(
    tmp_path: Path,
) -> None:
    with sim_replicas(tmp_path, 2, *SIM) as replicas, gateway(tmp_path, config_for(tmp_path, replicas)) as gw:
        home = gw.home_of("t0")
        other = next(name for name in replicas if name != home)
        path = f"/admin/replicas/llama/{home}"
        assert httpx.post(gw.url + path + "/drain").status_code == 401  # not without the admin token
        drained = gw.admin("POST", path + "/drain")
        assert drained.status_code == 200 and drained.json()["drained"] is True, drained.text
        before = served(replicas, "lora-t0")
        for _ in range(4):
            complete(gw, "t0", "lora-t0")
        during = served(replicas, "lora-t0")
        state = gw.admin("GET", "/admin/residency").json()["pools"]["llama"]["replicas"][home]
        assert gw.admin("POST", path + "/undrain").json()["drained"] is False
        for _ in range(4):
            complete(gw, "t0", "lora-t0")
        after = served(replicas, "lora-t0")
    assert (during[home] - before[home], during[other] - before[other]) == (0, 4)  # drained: none at home
    assert not state["healthy"], state  # out of the traffic, as the residency view says
    assert (after[home] - during[home], after[other] - during[other]) == (4, 0)  # home again


def test_without_an_admin_token_the_admin_api_is_off_and_tenants_are_served(tmp_path: Path) -> None:
    """No TENANTGATE_ADMIN_TOKEN: every admin route answers 404 (the answer of a route that does not exist), with or
    without a Bearer token; the status page's login refuses any token, saying why; tenants are served as before."""
    with (
        sim_replicas(tmp_path, 1, *SIM) as replicas,
        gateway(tmp_path, config_for(tmp_path, replicas), admin_token=False) as gw,
    ):
        complete(gw, "t0", "lora-t0")
        before = replicas["r0"].stats()["requests"]
        answers = {
            (method, path, bool(headers)): httpx.request(method, gw.url + path, headers=headers).status_code
            for method, path in [
                ("GET", "/admin/residency"),
                ("GET", "/admin/route?tenant=t0"),
                ("POST", "/admin/reload"),
                ("POST", "/admin/replicas/llama/r0/drain"),
                ("POST", "/admin/tenants"),
                ("GET", "/admin/state"),
            ]
            for headers in ({}, {"Authorization": f"Bearer {ADMIN_TOKEN}"})
        }
        login = httpx.post(gw.url + "/admin/ui/login", data={"token": ADMIN_TOKEN})
        during = replicas["r0"].stats()["requests"] - before
        complete(gw, "t1", "lora-t1")
    assert set(answers.values()) == {404}, answers
    assert login.status_code == 401 and "disabled" in login.text and "set-cookie" not in login.headers
    assert during == 0  # nothing the admin calls asked for reached the engine


def test_a_tenant_added_at_run_time_survives_a_reload(tmp_path: Path) -> None:
    """A tenant added through the admin API (no Redis: the gateway's memory) is served, and still is after a reload
    of the config file, which does not name it; a reload that does not change its sources keeps it too."""
    with sim_replicas(tmp_path, 1, *SIM) as replicas:
        config = config_for(tmp_path, replicas)
        with gateway(tmp_path, config) as gw:
            late = {
                "id": "late",
                "api_keys": ["sha256:" + hashlib.sha256(api_key("late").encode()).hexdigest()],
                "adapters": ["lora-t1"],
                "base_models": [BASE_MODEL],
            }
            first = replicas["r0"].stats()["requests_by_model"].get("lora-t1", 0)
            added = httpx.post(gw.url + "/admin/tenants", json=late, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            assert added.status_code == 200, added.text
            complete(gw, "late", "lora-t1")
            config["tenants"] = [t for t in config["tenants"] if t["id"] != "t1"]  # the file changes meanwhile
            gw.write_config(config)
            reloaded = gw.admin("POST", "/admin/reload")
            assert reloaded.status_code == 200, reloaded.text
            complete(gw, "late", "lora-t1")
            with pytest.raises(openai.AuthenticationError):  # the reload did apply: t1 is gone
                complete(gw, "t1", "lora-t1")
            assert gw.admin("POST", "/admin/reload").status_code == 200
            complete(gw, "late", "lora-t1")
            served_late = replicas["r0"].stats()["requests_by_model"]["lora-t1"] - first
    assert served_late == 3


def test_a_clients_headers_never_reach_the_engine(tmp_path: Path) -> None:
    """The client sends its API key, a cookie, a session id and headers of its own; the engine sees none of them
    in any request (the gateway's own warm-ups included), and no header it sees carries the key."""
    own = {
        "Cookie": "session=s3cr3t-cookie",
        "X-Session-Id": "client-session-1",
        "X-Api-Key": "another-s3cr3t",
        "X-Custom-Thing": "s3cr3t-custom",
        "X-Forwarded-For": "203.0.113.9",
    }
    with sim_replicas(tmp_path, 1, *SIM) as replicas, gateway(tmp_path, config_for(tmp_path, replicas)) as gw:
        client = openai.OpenAI(
            base_url=gw.url + "/v1", api_key=api_key("t0"), max_retries=0, default_headers=own, timeout=30
        )
        client.completions.create(model="lora-t0", prompt="x", max_tokens=2)
        client.chat.completions.create(model="lora-t0", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        for chunk in client.completions.create(model="lora-t0", prompt="x", max_tokens=2, stream=True):
            assert chunk
        seen: list[dict[str, str]] = replicas["r0"].stats()["request_headers"]
    assert len(seen) >= 3, seen
    names = {name.lower() for headers in seen for name in headers}
    assert not names & {"authorization", *(name.lower() for name in own)}, names
    values = [value for headers in seen for value in headers.values()]
    assert not [v for v in values if api_key("t0") in v or "s3cr3t" in v], values
