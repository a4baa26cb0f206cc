"""Hostile bodies against a running gateway (a process, in front of a simulated replica): every one a 400 with an
OpenAI error body, one log line and a count, never a 500 or a traceback; and what reaches the engine is the body
the gateway checked, serialised again (checked on the bytes an in-process engine receives)."""

from __future__ import annotations

import gzip
import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from backends.registry import EngineSpec, NoSettings, register
from gateway.app import create_app
from gateway.config import ConfigError, GatewayConfig, parse_config
from loadtests.fleet import ADMIN_TOKEN, RunningFleet, api_key, fleet_with_gateway, gateway_config, write_adapters
from tests.gateway.residency.fakes import FakeDriver, FakeEngine

pytestmark = pytest.mark.timeout(180)

TENANTS = {"acme": ["support-acme"], "globex": ["sql-globex"]}
KEY = {"Authorization": f"Bearer {api_key('acme')}", "Content-Type": "application/json"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
DEEP_400 = b'{"prompt": "x", "user": ' + b"[" * 399 + b"]" * 399 + b"}"
DEEP_900 = b'{"prompt": "x", "user": ' + b"[" * 899 + b"]" * 899 + b"}"
CHAT = '{"messages": [{"role": "user", "content": %s}]%s}'


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    root = tmp_path_factory.mktemp("canonical")
    sim = ["--time-scale", "0", "--max-loras", "4"]
    splits = {"splits": [{"name": "ver", "variants": [{"model": "support-acme", "weight": 1}]}]}
    with fleet_with_gateway(root, TENANTS, 1, sim, extra={"telemetry": {"access_log": False}, **splits}) as running:
        running.adapters["root"] = str(root)
        yield running


def lines_since(read: Callable[[], str], before: str) -> list[str]:
    """The log's lines after ``before``, once at least one whole line has come: the log's writer writes in batches
    (up to 5 ms apart, gateway/observe/logs.py), so a request's line lands a moment after its answer. The lines one
    request logs are queued before its answer, so they come in one batch."""
    deadline = time.monotonic() + 10  # bounded poll
    while not (gained := read()[len(before) :]).endswith("\n"):
        assert time.monotonic() < deadline, f"no new log line: {gained[-2000:]!r}"
        time.sleep(0.01)
    return gained.splitlines()


def access_lines(lines: list[str]) -> list[dict[str, Any]]:
    return [line for line in map(json.loads, lines) if line["logger"] == "tenantgate.access"]


def gateway_log(fleet: RunningFleet) -> str:
    return (Path(fleet.adapters["root"]) / "gateway.log").read_text()


def refused_count(fleet: RunningFleet, surface: str, reason: str) -> float:
    text = httpx.get(fleet.gateway_url + "/metrics", headers=ADMIN).text
    found = re.search(rf'tenantgate_refused_inputs_total\{{reason="{reason}",surface="{surface}"\}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def assert_refused(fleet: RunningFleet, response: httpx.Response, surface: str, reason: str, before: float) -> None:
    assert response.status_code == 400, (response.status_code, response.text)
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert refused_count(fleet, surface, reason) == before + 1


@pytest.mark.parametrize(
    ("path", "body", "reason", "encoding"),
    [
        pytest.param("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "non_finite", None, id="nan"),
        pytest.param("/v1/completions", b'{"prompt": "x", "top_p": Infinity}', "non_finite", None, id="infinity"),
        pytest.param("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "unicode", None, id="surrogate"),
        pytest.param(
            "/v1/chat/completions", (CHAT % ('"\\udfff"', "")).encode(), "unicode", None, id="surrogate-in-chat"
        ),
        pytest.param("/v1/completions", DEEP_400, "depth", None, id="deep-400"),
        pytest.param("/v1/completions", DEEP_900, "depth", None, id="deep-900"),
        pytest.param("/v1/completions", b'{"prompt": "not gzip at all"}', "encoding", "gzip", id="not-gzip"),
        pytest.param("/v1/completions", b"not deflate", "encoding", "deflate", id="not-deflate"),
        pytest.param(
            "/v1/chat/completions",
            (CHAT % ('[{"type": "image_url", "image_url": {"url": "http://169.254.169.254/"}}]', "")).encode(),
            "content_part",
            None,
            id="image-part-on-a-text-pool",
        ),
        pytest.param(
            "/v1/chat/completions",
            (CHAT % ('"x"', ', "chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}')).encode(),
            "template_kwargs",
            None,
            id="template-in-kwargs",
        ),
    ],
)
def test_hostile_tenant_bodies_are_400s_with_one_log_line(
    fleet: RunningFleet, path: str, body: bytes, reason: str, encoding: str | None
) -> None:
    before, log_before = refused_count(fleet, "tenant", reason), gateway_log(fleet)
    headers = {**KEY, **({"Content-Encoding": encoding} if encoding else {})}
    response = httpx.post(fleet.gateway_url + path, content=body, headers=headers, timeout=30)
    assert_refused(fleet, response, "tenant", reason, before)
    new_lines = lines_since(lambda: gateway_log(fleet), log_before)
    assert not any("Traceback" in line or "Unhandled exception" in line for line in new_lines), new_lines
    assert [line for line in new_lines if "refused" in line and path in line] != []
    assert len(new_lines) == 1, new_lines
    ok = httpx.post(fleet.gateway_url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, headers=KEY)
    assert ok.status_code == 200, ok.text


def test_with_the_access_log_on_the_refusal_is_its_access_line(tmp_path: Path) -> None:
    with fleet_with_gateway(tmp_path, TENANTS, 1, ["--time-scale", "0"]) as logged:
        log_path = tmp_path / "gateway.log"
        before = log_path.read_text()
        body = b'{"prompt": "x", "temperature": NaN}'
        response = httpx.post(logged.gateway_url + "/v1/completions", content=body, headers=KEY, timeout=30)
        assert response.status_code == 400
        # The log is written off the event loop, so the start-up fill's lines may land after `before` was read, in
        # a batch of their own: only access lines are this request's.
        deadline = time.monotonic() + 10  # bounded poll
        while not (access := access_lines(lines_since(log_path.read_text, before))):
            assert time.monotonic() < deadline, "no access line"
            time.sleep(0.01)
    assert len(access) == 1, access
    line = access[0]
    assert line["status"] == 400 and line["error"] == "refused:non_finite"


def test_a_real_gzip_body_is_served(fleet: RunningFleet) -> None:
    body = gzip.compress(b'{"model": "support-acme", "prompt": "zipped", "max_tokens": 2}')
    headers = {**KEY, "Content-Encoding": "gzip"}
    response = httpx.post(fleet.gateway_url + "/v1/completions", content=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text


def test_an_undecodable_api_key_is_a_401_not_a_500(fleet: RunningFleet) -> None:
    host, port = fleet.gateway_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\nConnection: close\r\n\r\n"
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


def test_an_empty_model_is_the_tenants_default_as_in_vllm(fleet: RunningFleet) -> None:
    client = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key("acme"), max_retries=0)
    answer = client.completions.create(model="", prompt="no model", max_tokens=2)
    assert answer.model == "support-acme"


@pytest.mark.parametrize(
    ("first", "last", "status"),
    [("sql-globex", "support-acme", 200), ("support-acme", "sql-globex", 404)],
    ids=["other-first", "own-first"],
)
def test_a_duplicated_model_key_is_judged_on_the_value_forwarded(
    fleet: RunningFleet, first: str, last: str, status: int
) -> None:
    body = f'{{"model": "{first}", "prompt": "dup", "max_tokens": 2, "model": "{last}"}}'.encode()
    response = httpx.post(fleet.gateway_url + "/v1/completions", content=body, headers=KEY, timeout=30)
    assert response.status_code == status, response.text
    if status == 200:
        assert response.json()["model"] == "support-acme"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/admin/tenants", b'{"id": ' + b"[" * 899 + b"]" * 899 + b"}", id="deep-tenant"),
        pytest.param("/admin/catalog/adapters", b'{"name": "x", "pool": NaN}', id="nan-adapter"),
        pytest.param("/admin/tenants/acme/keys", b'{"api_key": "\\ud800"}', id="surrogate-key"),
        pytest.param("/admin/adapters/ver/rollout", b"[]", id="rollout-list"),
        pytest.param("/admin/adapters/ver/rollout", b'{"version": 2, "step_s": "soon"}', id="rollout-step-s-text"),
        pytest.param("/admin/adapters/ver/rollout", b'{"version": 2, "steps": []}', id="rollout-no-steps"),
    ],
)
def test_hostile_admin_bodies_are_400s(fleet: RunningFleet, path: str, body: bytes) -> None:
    log_before = gateway_log(fleet)
    response = httpx.post(fleet.gateway_url + path, content=body, headers=ADMIN, timeout=30)
    assert response.status_code == 400, (response.status_code, response.text)
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in gateway_log(fleet)[len(log_before) :]


def test_a_non_ascii_csrf_token_is_a_400(fleet: RunningFleet) -> None:
    with httpx.Client(base_url=fleet.gateway_url, timeout=30) as page:
        login = page.post("/admin/ui/login", data={"token": ADMIN_TOKEN})
        assert login.status_code in (200, 303), login.text
        before = refused_count(fleet, "admin", "shape")
        headers: dict[str, Any] = {"X-CSRF-Token": "jeton-\u00e9".encode(), "Content-Type": "application/json"}
        response = page.post("/admin/ui/actions/drain", content=b"{}", headers=headers)
        assert_refused(fleet, response, "admin", "shape", before)
        wrong = page.post("/admin/ui/actions/drain", content=b"{}", headers={"X-CSRF-Token": "wrong"})
        assert wrong.status_code == 401


def test_a_pool_may_not_allow_a_template() -> None:
    with pytest.raises(ConfigError, match="may not allow a template"):
        parse_config(
            "pools: [{name: p, backend: vllm, base_model: m, replicas: [{id: r, url: 'http://h:1'}],"
            " chat_template_kwargs: [enable_thinking, chat_template]}]\n"
            "tenants: [{id: t, api_keys: ['sha256:" + "0" * 64 + "'], base_models: [m]}]\n"
        )


# --- what the engine receives: an in-process gateway whose engine records the bytes it was sent ---------------
ENGINE = FakeEngine()
register(EngineSpec("canonical-fake", NoSettings, lambda settings, pool: FakeDriver(ENGINE)))


def in_process_config(tmp_path: Path) -> GatewayConfig:
    adapters = write_adapters(tmp_path, ["support-acme", "sql-globex"])
    raw = gateway_config({"r0": "http://127.0.0.1:9"}, TENANTS, adapters, port=0)
    raw["pools"][0].update(backend="canonical-fake", chat_template_kwargs=["enable_thinking"])
    # No start-up warm-up: its one-token requests, late on a busy machine, landed among the bodies recorded below.
    raw.setdefault("residency", {})["fill_warm_up"] = False
    return GatewayConfig.model_validate(raw)


async def test_the_engine_receives_the_body_that_was_checked(tmp_path: Path) -> None:
    async with TestClient(TestServer(create_app(in_process_config(tmp_path)))) as client:
        sent = [
            b'{"model": "sql-globex", "prompt": "dup", "max_tokens": 2, "model": "support-acme"}',
            b'{"model": "", "prompt": "empty", "max_tokens": 2}',
            b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": true}}',
        ]
        paths = ["/v1/completions", "/v1/completions", "/v1/chat/completions"]
        for path, body in zip(paths, sent, strict=True):
            ENGINE.warm_requests.clear()
            response = await client.post(path, data=body, headers=KEY)
            assert response.status == 200, await response.text()
            ((_, received),) = ENGINE.warm_requests
            assert received.count(b'"model"') == 1, received
            assert b'"model":"support-acme"' in received, received
        assert b'"chat_template_kwargs":{"enable_thinking":true}' in received
