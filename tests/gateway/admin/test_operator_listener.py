"""Metrics are not for tenants (issue 20, "Shared-state and operator surfaces"): /metrics names every tenant and
adapter. On the tenant port it needs the metrics or the admin token; with ``admin.listen`` set, /metrics and
/admin answer only on that listener and tenant paths only on the tenant port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.admin.operator import OperatorSite
from gateway.app import create_app
from gateway.config import GatewayConfig, OperatorListenConfig
from gateway.observe.metrics import GatewayMetrics
from gateway.server import listen
from gateway.serving.connections import ConnectionGuard
from gateway.serving.own_server import OwnSite
from loadtests.faultkit import GatewayUnderTest, sim_replicas
from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config, write_adapters
from loadtests.processes import free_port
from tests.gateway.admin.test_admin_surface import raw_config

ADMIN = "operator-test-admin-token-0123456789abcdef"
READER = "operator-test-metrics-token-0123456789abcdef"


@pytest.fixture
async def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TestClient[Any, Any]]:
    monkeypatch.setenv("TENANTGATE_ADMIN_TOKEN", ADMIN)
    monkeypatch.setenv("TENANTGATE_METRICS_TOKEN", READER)
    config = GatewayConfig.model_validate(raw_config(tmp_path))
    async with TestClient(TestServer(create_app(config))) as test_client:
        yield test_client


@pytest.mark.parametrize(
    ("authorization", "status"),
    [
        (None, 401),  # was 200: every tenant's and adapter's name, to anyone
        ("Bearer a-guess", 401),
        (f"Basic {READER}", 401),
        (f"Bearer {READER}", 200),
        (f"Bearer {ADMIN}", 200),
    ],
    ids=["none", "wrong", "not-bearer", "metrics-token", "admin-token"],
)
async def test_metrics_on_the_tenant_port_need_a_token(
    client: TestClient[Any, Any], authorization: str | None, status: int
) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = await client.get("/metrics", headers=headers)
    assert response.status == status, await response.text()
    if status == 200:
        assert "tenantgate_requests_total" in await response.text()
    else:
        assert set((await response.json())["error"]) == {"message", "type", "param", "code"}


async def test_wrong_metrics_tokens_count_as_failed_logins(client: TestClient[Any, Any]) -> None:
    for _ in range(10):
        assert (await client.get("/metrics", headers={"Authorization": "Bearer a-guess"})).status == 401
    limited = await client.get("/metrics", headers={"Authorization": f"Bearer {READER}"})
    assert limited.status == 429 and "Retry-After" in limited.headers


async def test_without_a_token_metrics_are_not_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENANTGATE_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("TENANTGATE_METRICS_TOKEN", raising=False)
    config = GatewayConfig.model_validate(raw_config(tmp_path))
    async with TestClient(TestServer(create_app(config))) as anonymous:
        response = await anonymous.get("/metrics")
        assert response.status == 404
        assert (await response.json())["error"]["code"] == "not_found"


def test_a_weak_metrics_token_is_refused_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENANTGATE_METRICS_TOKEN", "change-me")
    config = GatewayConfig.model_validate(raw_config(tmp_path))
    with pytest.raises(Exception, match="metrics token is a known default"):
        create_app(config)


def test_the_operator_listener_is_loopback_unless_set() -> None:
    assert OperatorListenConfig(port=9090).host == "127.0.0.1"
    assert GatewayConfig.model_fields["admin"].default.listen is None  # off unless configured: tokens instead


def test_an_operator_listener_takes_metrics_and_admin_off_the_tenant_port(tmp_path: Path) -> None:
    """A gateway process with admin.listen: the tenant port answers /metrics, /admin/state and the status page
    with the 404 of an unknown route (token or not); the operator port serves /metrics without a token and /admin
    with the admin token, and no tenant path. Probes answer on both. Tenants are served as before."""
    operator_port = free_port()
    with sim_replicas(tmp_path, 1, "--time-scale", "0") as replicas:
        adapters = write_adapters(tmp_path, ["lora-a"])
        urls = {name: replica.url for name, replica in replicas.items()}
        config = gateway_config(urls, {"acme": ["lora-a"]}, adapters, port=free_port())
        config["admin"] = {"listen": {"host": "127.0.0.1", "port": operator_port}}
        gateway = GatewayUnderTest(tmp_path, config)
        gateway.start()
        try:
            tenant, operator = gateway.url, f"http://127.0.0.1:{operator_port}"
            admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            client = openai.OpenAI(base_url=tenant + "/v1", api_key=api_key("acme"), max_retries=0, timeout=30)
            assert client.completions.create(model="lora-a", prompt="hello", max_tokens=2).choices
            for path in ("/metrics", "/admin/state", "/admin/ui"):
                refused = httpx.get(tenant + path, headers=admin, timeout=10)
                assert refused.status_code == 404, (path, refused.text)  # was 200
                assert refused.json()["error"]["code"] == "not_found"
            scraped = httpx.get(operator + "/metrics", timeout=10)
            assert scraped.status_code == 200 and 'tenant="acme"' in scraped.text
            assert httpx.get(operator + "/admin/state", timeout=10).status_code == 401
            assert httpx.get(operator + "/admin/state", headers=admin, timeout=10).status_code == 200
            models = httpx.get(operator + "/v1/models", headers={"Authorization": f"Bearer {api_key('acme')}"})
            assert models.status_code == 404
            # An inference route too, which the server hands its handler without aiohttp's router (gateway/app.py's
            # direct): the listener check holds there as well.
            body = {"model": "lora-a", "prompt": "hello", "max_tokens": 2}
            tenant_key = {"Authorization": f"Bearer {api_key('acme')}"}
            completion = httpx.post(operator + "/v1/completions", json=body, headers=tenant_key, timeout=10)
            assert completion.status_code == 404, completion.text
            for url in (tenant, operator):
                assert httpx.get(url + "/healthz", timeout=10).status_code == 200
                assert httpx.get(url + "/readyz", timeout=10).status_code == 200
        finally:
            gateway.stop()


async def test_an_ephemeral_operator_port_is_reported_as_the_one_bound(tmp_path: Path) -> None:
    """admin.listen with port 0: the operator site's port and name (what serve logs) are the port the kernel
    chose, and the listener answers there (the operator site said 0: it never recorded its bound port)."""
    raw = raw_config(tmp_path)
    raw["admin"] = {"listen": {"host": "127.0.0.1", "port": 0}}
    config = GatewayConfig.model_validate(raw)
    assert config.listen.port == 0

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/healthz", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        sites = await listen(runner, config, ConnectionGuard(config.listen, GatewayMetrics()), None)
        assert [type(site) for site in sites] == [OwnSite, OperatorSite]
        for site in sites:
            assert site.port != 0 and site.name == f"http://127.0.0.1:{site.port}"
        assert sites[0].port != sites[1].port
        async with httpx.AsyncClient() as client:
            answer = await client.get(f"http://127.0.0.1:{sites[1].port}/healthz", timeout=10)
        assert answer.status_code == 200 and answer.text == "ok"
    finally:
        await runner.cleanup()
