"""Redis decides who is a tenant, so the gateway logs in to it (issue 20, "Shared-state and operator surfaces"):
the password from an environment variable or a file (never the config), CA and client-certificate files for
rediss://. Against a real redis-server that requires TLS, a password and a client certificate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import redis.exceptions
from pydantic import ValidationError

from gateway.config import ConfigError, StateConfig
from gateway.redis_client import make_client, redis_access, secret
from loadtests.faultkit import GatewayUnderTest, sim_replicas
from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config, write_adapters
from loadtests.processes import free_port
from tests.support.secure_redis import SecureRedis, secure_redis

pytestmark = pytest.mark.timeout(120)

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ({"redis_url": "redis://:hunter2@redis:6379/0"}, "holds a password"),
        ({"redis_url": "rediss://gw:hunter2@redis:6379/0"}, "holds a password"),
        ({"redis_url": "redis://redis:6379/0?password=hunter2"}, "holds a password"),
        ({"redis_url": "redis://redis:6379/0", "password_env": "A", "password_file": "/b"}, "not both"),
        ({"redis_url": "redis://redis:6379/0", "tls": {"ca_file": "/ca.crt"}}, "needs a rediss://"),
        ({"redis_url": "rediss://redis:6379/0", "tls": {"key_file": "/k"}}, "key_file needs cert_file"),
        ({"redis_url": "redis://gw@redis:6379/0", "password_env": "A"}, None),  # a user name is no secret
        ({"redis_url": "rediss://redis:6379/0", "password_file": "/p", "tls": {"ca_file": "/ca"}}, None),
    ],
    ids=["url-password", "url-user-password", "query-password", "env-and-file", "tls-plain", "key-alone", "user", "ok"],
)
def test_the_config_holds_no_redis_password(state: dict[str, Any], problem: str | None) -> None:
    if problem is None:
        StateConfig.model_validate(state)
        return
    with pytest.raises(ValidationError, match=problem):
        StateConfig.model_validate(state)


def test_a_named_secret_must_be_there(tmp_path: Path) -> None:
    assert secret({"P": "s3cret"}, "P", None, "state.password") == "s3cret"
    assert secret({}, None, None, "state.password") is None
    with pytest.raises(ConfigError, match="P is not set"):
        secret({}, "P", None, "state.password")
    written = tmp_path / "password"
    written.write_text("s3cret\n")  # as `kubectl create secret --from-file` keeps an editor's newline
    assert secret({}, None, str(written), "state.password") == "s3cret"
    written.write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        secret({}, None, str(written), "state.password")
    with pytest.raises(ConfigError, match="cannot read"):
        secret({}, None, str(tmp_path / "missing"), "state.password")


def _state(server: SecureRedis, tmp_path: Path, **overrides: Any) -> StateConfig:
    password_file = tmp_path / "redis-password"
    password_file.write_text(server.password + "\n")
    tls = {"ca_file": str(server.ca_file), "cert_file": str(server.cert_file), "key_file": str(server.key_file)}
    raw = {"redis_url": server.url, "password_file": str(password_file), "tls": tls, **overrides}
    return StateConfig.model_validate({k: v for k, v in raw.items() if v is not None})


async def test_the_client_logs_in_with_the_password_file_and_client_certificate(tmp_path: Path) -> None:
    with secure_redis(tmp_path) as server:
        full = make_client(server.url, 5, access=redis_access(_state(server, tmp_path), {}))
        assert await full.ping()
        await full.aclose()
        # Each part is needed: without the password, or without the client certificate, Redis refuses; and the
        # gateway checks the server's certificate (against a CA that did not sign it, it does not talk).
        wrong_ca = {
            "ca_file": str(server.cert_file),
            "cert_file": str(server.cert_file),
            "key_file": str(server.key_file),
        }
        for missing, error in (
            ({"password_file": None}, redis.exceptions.AuthenticationError),
            ({"tls": {"ca_file": str(server.ca_file)}}, redis.exceptions.ConnectionError),
            ({"tls": wrong_ca}, redis.exceptions.ConnectionError),
        ):
            client = make_client(server.url, 5, access=redis_access(_state(server, tmp_path, **missing), {}))
            with pytest.raises(error):
                await client.ping()
            await client.aclose()
        # The same server by an address its certificate does not name: refused (the host name is checked).
        by_address = server.url.replace("localhost", "127.0.0.1")
        elsewhere = make_client(by_address, 5, access=redis_access(_state(server, tmp_path, redis_url=by_address), {}))
        with pytest.raises(redis.exceptions.ConnectionError, match=r"match|mismatch|hostname"):
            await elsewhere.ping()
        await elsewhere.aclose()


def test_a_gateway_shares_its_registry_through_a_secured_redis(tmp_path: Path) -> None:
    """`tenantgate serve` with the password in an environment variable and the TLS files: the residency store is
    up and a key added through the admin API is written to Redis and works."""
    with secure_redis(tmp_path) as server, sim_replicas(tmp_path, 1, "--time-scale", "0") as replicas:
        adapters = write_adapters(tmp_path, ["lora-a"])
        urls = {name: replica.url for name, replica in replicas.items()}
        tls = {"ca_file": str(server.ca_file), "cert_file": str(server.cert_file), "key_file": str(server.key_file)}
        state = {"redis_url": server.url, "password_env": "TEST_REDIS_PASSWORD", "tls": tls}
        config = gateway_config(urls, {"acme": ["lora-a"]}, adapters, port=free_port(), extra={"state": state})
        gateway = GatewayUnderTest(tmp_path, config)
        gateway.env["TEST_REDIS_PASSWORD"] = server.password
        gateway.start()
        try:
            assert httpx.get(gateway.url + "/readyz", timeout=10).json()["residency_store"] == "up"
            added = httpx.post(gateway.url + "/admin/tenants/acme/keys", json={}, headers=ADMIN, timeout=10)
            assert added.status_code == 200, added.text
            assert server.client().hlen("tg:{registry}:entries") == 1
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=added.json()["api_key"], max_retries=0)
            assert client.completions.create(model="lora-a", prompt="hi", max_tokens=2).choices
            assert api_key("acme") != added.json()["api_key"]
        finally:
            gateway.stop()


def test_serve_refuses_a_named_password_that_is_not_there(tmp_path: Path) -> None:
    with sim_replicas(tmp_path, 1, "--time-scale", "0") as replicas:
        adapters = write_adapters(tmp_path, ["lora-a"])
        urls = {name: replica.url for name, replica in replicas.items()}
        state = {"redis_url": "redis://127.0.0.1:1/0", "password_env": "TEST_REDIS_PASSWORD_UNSET"}
        config = gateway_config(urls, {"acme": ["lora-a"]}, adapters, port=free_port(), extra={"state": state})
        gateway = GatewayUnderTest(tmp_path, config)
        with pytest.raises(RuntimeError, match="TEST_REDIS_PASSWORD_UNSET is not set"):
            gateway.start(timeout_s=20)
