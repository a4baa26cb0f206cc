"""Dispatch's retry rule and its outcome reports, in-process through a fake engine whose replicas refuse
connections, or answer 500, on demand."""

from __future__ import annotations

from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from backends.base import Endpoint, EngineRequest
from backends.errors import EngineRejected, EngineUnavailable
from backends.registry import EngineSpec, NoSettings, register
from gateway.app import create_app
from gateway.appkeys import METRICS, STATE
from gateway.config import GatewayConfig
from loadtests.fleet import api_key, gateway_config, write_adapters
from tests.gateway.residency.fakes import FakeDriver, FakeEngine, FakeResponse

ENGINE = FakeEngine()
REFUSING: set[str] = set()  # replicas whose engine refuses connections
BROKEN: set[str] = set()  # replicas whose engine answers every request 500
POISON = b"poison"  # a prompt holding this makes every replica answer 500 (the request's own doing)


class RefusingDriver(FakeDriver):
    async def send(self, replica: Endpoint, request: EngineRequest) -> FakeResponse:
        if replica.id in REFUSING:
            raise EngineUnavailable(f"{replica.id} refused the connection")
        if replica.id in BROKEN or POISON in request.body:
            raise EngineRejected(500, "EngineCore encountered an issue", "InternalServerError")
        return await super().send(replica, request)


register(EngineSpec("dispatch-fake", NoSettings, lambda settings, pool: RefusingDriver(ENGINE)))


def config(tmp_path: Path, replicas: int) -> GatewayConfig:
    adapters = write_adapters(tmp_path, ["lora-a"])
    urls = {f"r{i}": f"http://127.0.0.1:{9 + i}" for i in range(replicas)}
    raw = gateway_config(urls, {"acme": ["lora-a"]}, adapters, port=0)
    raw["pools"][0]["backend"] = "dispatch-fake"
    return GatewayConfig.model_validate(raw)


async def test_a_retry_with_nowhere_else_to_go_answers_the_failures_own_error(tmp_path: Path) -> None:
    REFUSING.clear()
    REFUSING.add("r0")
    app = create_app(config(tmp_path, 1))
    async with TestClient(TestServer(app)) as client:
        response = await client.post(
            "/v1/completions",
            json={"model": "lora-a", "prompt": "hi"},
            headers={"Authorization": f"Bearer {api_key('acme')}"},
        )
        assert response.status == 502
        assert (await response.json())["error"]["code"] == "upstream_error"
        pool = app[STATE].serving.fleet.pools["llama"]
        assert pool.replicas["r0"].health.consecutive_failures == 1  # counted once, no phantom retry
        assert pool.in_flight == 0


async def test_a_refused_request_is_retried_once_on_the_next_replica(tmp_path: Path) -> None:
    REFUSING.clear()
    app = create_app(config(tmp_path, 2))
    async with TestClient(TestServer(app)) as client:
        pool = app[STATE].serving.fleet.pools["llama"]
        REFUSING.add(pool.ring.home("acme"))
        response = await client.post(
            "/v1/completions",
            json={"model": "lora-a", "prompt": "hi"},
            headers={"Authorization": f"Bearer {api_key('acme')}"},
        )
        assert response.status == 200, await response.text()
        home = pool.ring.home("acme")
        other = next(r for r in pool.replicas if r != home)
        assert pool.replicas[home].health.consecutive_failures == 1
        assert pool.replicas[other].health.consecutive_failures == 0
        assert pool.in_flight == 0 and all(r.in_flight == 0 for r in pool.replicas.values())


async def test_a_5xx_the_request_causes_everywhere_counts_against_no_replica(tmp_path: Path) -> None:
    """The issue's repro: five prompts that make the engine fail must not eject a replica. Each is tried once more
    elsewhere, fails there too, and so is the request's doing."""
    REFUSING.clear()
    BROKEN.clear()
    app = create_app(config(tmp_path, 2))
    async with TestClient(TestServer(app)) as client:
        pool = app[STATE].serving.fleet.pools["llama"]
        for _ in range(8):
            response = await client.post(
                "/v1/completions",
                json={"model": "lora-a", "prompt": "poison"},
                headers={"Authorization": f"Bearer {api_key('acme')}"},
            )
            assert response.status == 502
        assert [r.health.consecutive_failures for r in pool.replicas.values()] == [0, 0]
        assert all(r.healthy for r in pool.replicas.values())


async def test_a_broken_replica_serving_one_tenant_is_still_ejected(tmp_path: Path) -> None:
    """Tenant affinity: the home serves one tenant only. Its 500s succeed on the next replica, which points at the
    home: five of them eject it, and the tenant never saw an error."""
    REFUSING.clear()
    BROKEN.clear()
    app = create_app(config(tmp_path, 2))
    async with TestClient(TestServer(app)) as client:
        pool = app[STATE].serving.fleet.pools["llama"]
        home = pool.ring.home("acme")
        BROKEN.add(home)
        for _ in range(5):
            response = await client.post(
                "/v1/completions",
                json={"model": "lora-a", "prompt": "hi"},
                headers={"Authorization": f"Bearer {api_key('acme')}"},
            )
            assert response.status == 200, await response.text()
        health = pool.replicas[home].health
        assert health.ejected and health.ejection_reason == "failed_here_only"
        assert pool.in_flight == 0
        exported = app[METRICS].exposition().decode()
        assert f'tenantgate_replica_ejections_total{{pool="llama",reason="failed_here_only",replica="{home}"}} 1.0' in (
            exported
        )
        # The upstream errors are the broken replica's, though the retries served the requests elsewhere.
        errors = f'tenantgate_upstream_errors_total{{kind="EngineRejected",pool="llama",replica="{home}"}} 5.0'
        assert errors in exported, [line for line in exported.splitlines() if "upstream_errors_total{" in line]
