"""A refused adapter load says why in the access log: the engine's own reason, not only the error's kind."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.observe.logs import json_formatter
from loadtests.fleet import api_key, gateway_config
from tests.servers import EngineProcess


async def test_the_engines_reason_for_a_failed_load_is_in_the_log_line(
    sim_engine: EngineProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = str(tmp_path / "no-such-adapter")  # the engine cannot read it
    raw: dict[str, Any] = gateway_config({"r0": sim_engine.url}, {"acme": ["broken"]}, {"broken": missing}, port=0)
    caplog.set_level(logging.INFO, logger="tenantgate.access")
    async with TestClient(TestServer(create_app(GatewayConfig.model_validate(raw)))) as client:
        answer = await client.post(
            "/v1/completions",
            json={"model": "broken", "prompt": "x", "max_tokens": 2},
            headers={"Authorization": f"Bearer {api_key('acme')}"},
        )
        assert answer.status == 502
        assert missing not in await answer.text()  # the engine's reason is the operator's, not the client's
    [line] = [json.loads(json_formatter().format(r)) for r in caplog.records if r.name == "tenantgate.access"]
    assert line["error"] == "AdapterLoadFailed"
    assert f"No adapter found for {missing}" in line["error_detail"], line
