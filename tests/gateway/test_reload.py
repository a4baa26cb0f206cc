"""A reload applies what it can and names what it cannot: each setting bound to the running process that the file
changes is in the answer's restart_required, a warning in the log and tenantgate_config_restart_pending; the
others (here telemetry.access_log and shutdown.drain_delay_s) take effect at once."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from uhashring import HashRing

from gateway.app import create_app
from gateway.appkeys import STATE
from gateway.config import GatewayConfig
from gateway.reload import RESTART_ONLY
from gateway.routing import ring as ring_module
from loadtests.fleet import api_key, gateway_config
from tests.servers import EngineProcess

TOKEN = "reload-test-admin-token-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def _config(sim: EngineProcess, **changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = gateway_config({"r0": sim.url}, {"acme": ["a1"]}, {"a1": sim.adapters["a1"]}, port=0)
    return {**raw, **changes}


async def _reload(client: TestClient[Any, Any], path: Path, config: dict[str, Any]) -> dict[str, Any]:
    await asyncio.to_thread(path.write_text, yaml.safe_dump(config))
    answer = await client.post("/admin/reload", headers=ADMIN)
    assert answer.status == 200, await answer.text()
    body: dict[str, Any] = await answer.json()
    return body


async def test_restart_only_changes_are_named_in_the_answer_the_log_and_a_metric(
    sim_engine: EngineProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TENANTGATE_ADMIN_TOKEN", TOKEN)
    path = tmp_path / "gateway.yaml"
    first = _config(sim_engine)
    path.write_text(yaml.safe_dump(first))
    changed = _config(
        sim_engine,
        listen={"host": "127.0.0.1", "port": 1},
        state={"redis_url": "redis://127.0.0.1:1/0"},
        shutdown={"drain_delay_s": 5, "drain_timeout_s": 7},
        telemetry={"access_log": False},
    )
    app = create_app(GatewayConfig.model_validate(first), path)
    caplog.set_level(logging.WARNING, logger="gateway.reload")
    async with TestClient(TestServer(app)) as client:
        expected = ["listen.port", "shutdown.drain_timeout_s", "state.redis_url"]
        answer = await _reload(client, path, changed)
        assert answer["restart_required"] == expected
        assert answer["warnings"] == [f"{name} changed but applies only after a restart" for name in expected]
        logged = [r.getMessage() for r in caplog.records if r.name == "gateway.reload"]
        assert logged == [f"reload: {w}" for w in answer["warnings"]]
        metrics = await (await client.get("/metrics", headers=ADMIN)).text()
        for name in expected:
            assert f'tenantgate_config_restart_pending{{field="{name}"}} 1.0' in metrics
        # The process still runs its start-up values: a second reload of the same file says so again.
        assert (await _reload(client, path, changed))["restart_required"] == expected
        # What a reload applies has applied (the server reads drain_delay_s at SIGTERM from the served config).
        assert app[STATE].config.shutdown.drain_delay_s == 5
        # Back to what runs: nothing pending.
        assert (await _reload(client, path, first))["restart_required"] == []
        metrics = await (await client.get("/metrics", headers=ADMIN)).text()
        for name in expected:  # 0, not dropped: under --workers a dropped series would keep its 1 in the worker's file
            assert f'tenantgate_config_restart_pending{{field="{name}"}} 0.0' in metrics


async def test_the_access_log_switch_applies_at_reload(
    sim_engine: EngineProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TENANTGATE_ADMIN_TOKEN", TOKEN)
    path = tmp_path / "gateway.yaml"
    first = _config(sim_engine)
    path.write_text(yaml.safe_dump(first))
    caplog.set_level(logging.INFO, logger="tenantgate.access")
    async with TestClient(TestServer(create_app(GatewayConfig.model_validate(first), path))) as client:

        async def access_lines_of_one_request() -> int:
            caplog.clear()
            answer = await client.post(
                "/v1/completions",
                json={"model": "a1", "prompt": "x", "max_tokens": 2},
                headers={"Authorization": f"Bearer {api_key('acme')}"},
            )
            assert answer.status == 200, await answer.text()
            return sum(1 for r in caplog.records if r.name == "tenantgate.access")

        assert await access_lines_of_one_request() == 1
        answer = await _reload(client, path, _config(sim_engine, telemetry={"access_log": False}))
        assert answer["restart_required"] == []
        assert await access_lines_of_one_request() == 0


async def test_a_reload_places_the_ring_points_off_the_event_loop(
    sim_engine: EngineProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ring's points cost an md5 each (about a second of CPU at 1,000 replicas): a reload that changes a ring
    places them on a worker thread, never on the event loop every tenant's requests run on."""
    monkeypatch.setenv("TENANTGATE_ADMIN_TOKEN", TOKEN)
    placed_on: list[int] = []

    class RecordingHashRing(HashRing):  # type: ignore[misc]  # uhashring has no types
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            placed_on.append(threading.get_ident())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(ring_module, "HashRing", RecordingHashRing)
    path = tmp_path / "gateway.yaml"
    first = _config(sim_engine)
    path.write_text(yaml.safe_dump(first))
    async with TestClient(TestServer(create_app(GatewayConfig.model_validate(first), path))) as client:
        placed_on.clear()  # start-up's, before the gateway serves
        changed = _config(sim_engine, routing={**first["routing"], "vnodes": 37})  # a ring no other test holds
        assert (await _reload(client, path, changed))["restart_required"] == []
        assert placed_on, "the new ring's points were placed"
        assert threading.get_ident() not in placed_on
        placed_on.clear()  # the same replicas and vnodes again: taken from the memo, placed nowhere
        await _reload(client, path, changed)
        assert placed_on == []


def test_the_docs_name_every_restart_only_setting() -> None:
    repo = Path(__file__).resolve().parents[2]
    for doc in ("README.md", "docs/operations.md"):
        text = " ".join((repo / doc).read_text().split())
        assert all(f"`{name}`" in text for name in RESTART_ONLY), doc
