"""Adapter sources: what an engine may be told to read, from the config file or the admin API (the review sent
``../../etc``, ``/proc/self``, ``file://``, a link-local URL and paths with NUL or newline through the admin API,
and gave a new adapter another tenant's source; each was accepted and sent to the engine)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from backends.registry import EngineSpec, NoSettings, register
from gateway.adapter_sources import SourceRefused, check, directories_of, normalised
from gateway.app import create_app
from gateway.appkeys import STATE
from gateway.config import ConfigError, GatewayConfig, parse_config
from loadtests.fleet import gateway_config, write_adapters
from tests.gateway.residency.fakes import FakeDriver, FakeEngine

TOKEN = "sources-test-admin-token-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
register(EngineSpec("sources-fake", NoSettings, lambda settings, pool: FakeDriver(FakeEngine())))


@pytest.mark.parametrize(
    ("source", "kept"),
    [
        ("/srv/loras/a", "/srv/loras/a"),
        ("/srv//loras/./a/", "/srv/loras/a"),
        ("//srv/loras/a", "/srv/loras/a"),
        ("org/adapter", "org/adapter"),  # relative (or a hub id): allowed where no roots are set
        ("s3://bucket/loras/a", "s3://bucket/loras/a"),
    ],
)
def test_sources_are_kept_normalised(source: str, kept: str) -> None:
    assert normalised(source) == kept


@pytest.mark.parametrize(
    "source",
    [
        "../../etc",
        "/srv/loras/../../etc",
        "a/..",
        "..\\etc",
        "file:///etc/passwd",
        "/srv/a\x00b",
        "/srv/a\nb",
        "/srv/\r",
    ],
)
def test_what_no_configuration_allows(source: str) -> None:
    with pytest.raises(SourceRefused):
        normalised(source)


@pytest.mark.parametrize(
    ("source", "allowed"),
    [
        ("/srv/loras/a", True),
        ("/srv/loras", True),
        ("/srv/lorasx/a", False),  # by component, not by prefix
        ("/proc/self/environ", False),
        ("relative/a", False),
        ("https://models.example.com/a", True),
        ("s3://bucket/a", False),  # scheme not allowed
        ("https://169.254.169.254/latest/meta-data", False),
        ("https://[fe80::1]/a", False),
        ("https://127.0.0.1/a", False),
        ("https://10.1.2.3/a", False),
        ("https://localhost/a", False),
        ("https://metadata.google.internal/a", False),
        ("https://2852039166/a", False),  # 169.254.169.254 as one number
        ("https://0xa9fea9fe/a", False),
    ],
)
def test_roots_and_schemes(source: str, allowed: bool) -> None:
    if allowed:
        check(source, ["/srv/loras"], ["https"])
    else:
        with pytest.raises(SourceRefused):
            check(source, ["/srv/loras"], ["https"])


def test_the_admin_apis_default_roots_are_the_files_adapter_directories() -> None:
    assert directories_of(["/srv/loras/a", "/srv/loras/b", "/opt/x/y", "/top", "rel/a", "s3://b/a"]) == [
        "/opt/x",
        "/srv/loras",
    ]


CONFIG = """
pools: [{name: p, backend: vllm, base_model: m, replicas: [{id: r, url: 'http://h:1'}]}]
tenants: [{id: t, api_keys: ['sha256:%s'], base_models: [m]}]
""" % ("0" * 64)


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        ("adapters: [{name: a, pool: p, source: '/srv/../etc'}]", "adapters.0.source: .*'\\.\\.'"),
        ("adapter_sources: {roots: [/srv/loras]}\nadapters: [{name: a, pool: p, source: /etc/a}]", "not under"),
        ("adapters: [{name: a, pool: p, source: /s/x}, {name: b, pool: p, source: '/s//x/'}]", "adapters.1.source"),
        (
            "adapters: [{name: a, pool: p, source: /s/x, shared_source: true}, {name: b, pool: p, source: /s/x}]",
            "shared_source",
        ),
        ("adapters: [{name: a, pool: p, source: 'https://169.254.169.254/x'}]", "scheme 'https' is not"),
    ],
)
def test_the_config_file_is_checked_the_same_way(extra: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_config(CONFIG + extra)


def test_a_source_shared_on_purpose_and_the_normalised_form() -> None:
    shared = (
        "adapters: [{name: a, pool: p, source: /s/x, shared_source: true},"
        " {name: b, pool: p, source: /s/x/, shared_source: true}]"
    )
    config = parse_config(CONFIG + shared)
    assert [a.source for a in config.adapters] == ["/s/x", "/s/x"]


@pytest.fixture
async def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[TestClient[Any, Any], str]]:
    monkeypatch.setenv("TENANTGATE_ADMIN_TOKEN", TOKEN)
    adapters = write_adapters(tmp_path, ["support-acme"])
    raw = gateway_config({"r0": "http://127.0.0.1:9"}, {"acme": ["support-acme"]}, adapters, port=0)
    raw["pools"][0]["backend"] = "sources-fake"
    async with TestClient(TestServer(create_app(GatewayConfig.model_validate(raw)))) as test_client:
        yield test_client, str(tmp_path / "adapters")


async def test_the_admin_api_refuses_what_the_review_sent(client: tuple[TestClient[Any, Any], str]) -> None:
    http, root = client
    refused = {
        "dot-dot": f"{root}/../../etc",
        "proc": "/proc/self",
        "file-url": "file:///etc/passwd",
        "link-local": "http://169.254.169.254/latest/meta-data/",
        "nul": f"{root}/x\x00y",
        "newline": f"{root}/x\ny",
        "another-adapters": f"{root}/support-acme",
        "outside-the-roots": "/tmp/elsewhere",
    }
    for case, source in refused.items():
        answer = await http.post("/admin/catalog/adapters", json={"name": "new", "pool": "llama", "source": source},
                                   headers=ADMIN)  # fmt: skip
        assert answer.status == 400, (case, await answer.text())  # was: 200 for every one
        assert (await answer.json())["error"]["type"] == "invalid_request_error"
    fine = {"name": "new", "pool": "llama", "source": f"{root}//new/"}
    added = await http.post("/admin/catalog/adapters", json=fine, headers=ADMIN)
    assert added.status == 200, await added.text()
    catalog = http.app[STATE].serving.config.adapters
    assert {a.name: a.source for a in catalog}["new"] == f"{root}/new"  # what engines get: normalised
