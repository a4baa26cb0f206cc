"""The admin surface's defaults (issue 20, "Shared-state and operator surfaces"): a weak admin token is refused
at start, failed logins are limited per source address, admin answers are never cached or sniffed and the page's
cookie is Secure over TLS, and a key added at run time is long enough or generated."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from backends.registry import EngineSpec, NoSettings, register
from gateway.admin.auth import FailedLogins, admin_token
from gateway.app import create_app
from gateway.config import AdminConfig, ConfigError, GatewayConfig
from gateway.errors import RequestRateLimited
from loadtests.fleet import api_key, gateway_config, write_adapters
from tests.clock import Clock
from tests.gateway.residency.fakes import FakeDriver, FakeEngine

TOKEN = "surface-test-admin-token-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
register(EngineSpec("surface-fake", NoSettings, lambda settings, pool: FakeDriver(FakeEngine())))


def raw_config(tmp_path: Path, **admin: Any) -> dict[str, Any]:
    adapters = write_adapters(tmp_path, ["support-acme"])
    raw = gateway_config({"r0": "http://127.0.0.1:9"}, {"acme": ["support-acme"]}, adapters, port=0)
    raw["pools"][0]["backend"] = "surface-fake"
    raw["admin"] = admin
    return raw


@pytest.fixture
async def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TestClient[Any, Any]]:
    monkeypatch.setenv("TENANTGATE_ADMIN_TOKEN", TOKEN)
    config = GatewayConfig.model_validate(raw_config(tmp_path, trusted_proxies=["127.0.0.0/8"]))
    async with TestClient(TestServer(create_app(config))) as test_client:
        yield test_client


@pytest.mark.parametrize(
    ("token", "problem"),
    [
        ("change-me", "known default"),
        ("CHANGEME", "known default"),
        ("a-fine-looking-but-short-token", "shorter than 32"),
        ("ab" * 20, "fewer than 8 distinct"),
        ("a-strong-admin-token-0123456789abcdef", None),
        ("", None),  # no token: the admin API is off, nothing to refuse
    ],
)
def test_weak_admin_tokens_are_refused(token: str, problem: str | None) -> None:
    environ = {"TENANTGATE_ADMIN_TOKEN": token}
    if problem is None:
        assert admin_token(AdminConfig(), environ) == token
        return
    with pytest.raises(ConfigError, match=problem):
        admin_token(AdminConfig(), environ)
    assert admin_token(AdminConfig(allow_weak_token=True), environ) == token  # the documented local override


def test_serve_refuses_to_start_with_a_weak_admin_token(tmp_path: Path) -> None:
    config = raw_config(tmp_path)
    config["pools"][0]["backend"] = "vllm"  # a process of its own: the fake engine is registered only here
    config_path = tmp_path / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(config))
    started = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path)],
        env={"TENANTGATE_ADMIN_TOKEN": "change-me", "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    output = started.stdout + started.stderr
    assert started.returncode == 1, output  # was: it served, with change-me as the admin token
    assert "known default" in output and "allow_weak_token" in output and "Traceback" not in output, output
    assert len([line for line in output.splitlines() if line.strip()]) == 1, output


def test_failed_logins_are_limited_per_address_on_a_fake_clock() -> None:
    clock = Clock()
    logins = FailedLogins(per_minute=10, clock=clock)
    for _ in range(10):
        logins.check("203.0.113.7")
        logins.failed("203.0.113.7")
    with pytest.raises(RequestRateLimited) as refused:
        logins.check("203.0.113.7")
    assert refused.value.headers["Retry-After"] == "6"  # one more failure's worth refills in 6 s
    logins.check("198.51.100.1")  # another address is not held back
    clock.advance(6)
    logins.check("203.0.113.7")
    small = FailedLogins(per_minute=1, clock=clock, max_addresses=2)
    for address in ("a", "b", "c"):
        small.failed(address)
    small.check("a")  # forgotten: memory is bounded, whoever floods


async def test_failed_admin_logins_get_429_before_the_token_is_compared(client: TestClient[Any, Any]) -> None:
    wrong = {"Authorization": "Bearer guess"}
    statuses = [(await client.get("/admin/state", headers=wrong)).status for _ in range(10)]
    assert statuses == [401] * 10
    refused = await client.get("/admin/state", headers=wrong)
    assert refused.status == 429 and int(refused.headers["Retry-After"]) >= 1  # was: 401, at full speed
    assert set((await refused.json())["error"]) == {"message", "type", "param", "code"}
    assert (await client.get("/admin/state", headers=ADMIN)).status == 429  # even the right token, for now
    page = await client.post("/admin/ui/login", data={"token": TOKEN})
    assert page.status == 429, await page.text()
    # Behind a trusted proxy, the address it forwards counts, not the proxy's own.
    elsewhere = {**ADMIN, "X-Forwarded-For": "198.51.100.1, 127.0.0.1"}
    assert (await client.get("/admin/state", headers=elsewhere)).status == 200
    metrics = await (await client.get("/metrics", headers=elsewhere)).text()
    assert 'tenantgate_admin_login_failures_total{outcome="wrong_token"} 10.0' in metrics
    assert 'tenantgate_admin_login_failures_total{outcome="rate_limited"} 3.0' in metrics


async def test_admin_answers_are_not_cached_or_sniffed_and_the_cookie_is_secure_over_tls(
    client: TestClient[Any, Any],
) -> None:
    for response in (
        await client.get("/admin/state"),
        await client.get("/admin/ui"),
        await client.get("/admin/ui/app.js"),
    ):
        assert response.headers["Cache-Control"] == "no-store", response.url
        assert response.headers["X-Content-Type-Options"] == "nosniff", response.url
    plain = await client.post("/admin/ui/login", data={"token": TOKEN}, allow_redirects=False)
    assert plain.status == 303 and "Secure" not in plain.headers["Set-Cookie"]  # over plain HTTP it would be lost
    # README, Status page: the session cookie is HttpOnly and SameSite=Strict, and lasts the session's 8 hours.
    cookie = plain.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and f"Max-Age={8 * 3600}" in cookie, cookie
    proxied = await client.post(
        "/admin/ui/login", data={"token": TOKEN}, headers={"X-Forwarded-Proto": "https"}, allow_redirects=False
    )
    assert proxied.status == 303 and "Secure" in proxied.headers["Set-Cookie"]  # was: never Secure


async def test_run_time_keys_are_long_or_generated(client: TestClient[Any, Any]) -> None:
    short = await client.post("/admin/tenants/acme/keys", json={"api_key": "short-key"}, headers=ADMIN)
    assert short.status == 400 and (await short.json())["error"]["param"] == "api_key"  # was: accepted
    made = await client.post("/admin/tenants/acme/keys", json={}, headers=ADMIN)
    assert made.status == 200, await made.text()
    key = (await made.json())["api_key"]
    assert key.startswith("tg-") and len(key) == 3 + 43  # 32 random bytes, URL-safe
    assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status == 200
    state = json.dumps(await (await client.get("/admin/state", headers=ADMIN)).json())
    assert key not in state  # returned once, kept nowhere
    own = "an-operator-chosen-key-0123456789abcdef"
    assert (await client.post("/admin/tenants/acme/keys", json={"api_key": own}, headers=ADMIN)).status == 200
    assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {own}"})).status == 200
    assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {api_key('acme')}"})).status == 200


async def test_admin_routes_mark_their_answers_and_tenant_answers_are_left_alone(
    client: TestClient[Any, Any],
) -> None:
    """Every answer of an admin route carries the admin headers: a page, an error the route raised (a refused
    body, a wrong token, an unknown asset) and the login's redirect. A tenant's answers, the probes and /metrics do
    not, and no hook runs on every response to tell them apart (one did: a path check per tenant response)."""
    assert client.app is not None and not client.app.on_response_prepare
    admin_answers = [
        (200, await client.get("/admin/state", headers=ADMIN)),
        (400, await client.post("/admin/tenants", headers=ADMIN, data=b"{not json")),
        (401, await client.get("/admin/state")),
        (404, await client.get("/admin/ui/missing.js")),
        (303, await client.post("/admin/ui/login", data={"token": TOKEN}, allow_redirects=False)),
    ]
    tenant = {"Authorization": f"Bearer {api_key('acme')}"}
    other_answers = [
        (200, await client.get("/v1/models", headers=tenant)),
        (401, await client.get("/v1/models")),
        (400, await client.post("/v1/completions", headers=tenant, data=b"{not json")),
        (200, await client.get("/healthz")),
        (200, await client.get("/metrics", headers=ADMIN)),
    ]
    for status, response in admin_answers:
        assert response.status == status, (response.url, await response.text())
        assert response.headers["Cache-Control"] == "no-store", response.url
        assert response.headers["X-Content-Type-Options"] == "nosniff", response.url
    for status, response in other_answers:
        assert response.status == status, (response.url, await response.text())
        assert "no-store" not in response.headers.get("Cache-Control", ""), response.url
        assert "X-Content-Type-Options" not in response.headers, response.url
