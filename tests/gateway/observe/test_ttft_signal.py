"""tenantgate_time_to_first_token_seconds measures what its name says: a stream's first chunk. A whole answer's
first byte is its last, so non-streamed requests count only in tenantgate_request_duration_seconds (and their
access-log line has no ttft_ms)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from gateway.appkeys import METRICS
from gateway.config import GatewayConfig
from gateway.observe.logs import json_formatter
from loadtests.fleet import api_key, gateway_config
from tests.servers import EngineProcess


def _count(metrics: str, family: str) -> float:
    [value] = re.findall(rf'^{family}_count\{{adapter="a1",pool="llama",tenant="acme"\}} (\S+)$', metrics, re.MULTILINE)
    return float(value)


async def test_only_streams_count_as_time_to_first_token(
    sim_engine: EngineProcess, caplog: pytest.LogCaptureFixture
) -> None:
    raw: dict[str, Any] = gateway_config(
        {"r0": sim_engine.url}, {"acme": ["a1"]}, {"a1": sim_engine.adapters["a1"]}, port=0
    )
    caplog.set_level(logging.INFO, logger="tenantgate.access")
    async with TestClient(TestServer(create_app(GatewayConfig.model_validate(raw)))) as client:
        auth = {"Authorization": f"Bearer {api_key('acme')}"}
        for stream in (False, True):
            body = {"model": "a1", "prompt": "x", "max_tokens": 3, "stream": stream}
            answer = await client.post("/v1/completions", json=body, headers=auth)
            assert answer.status == 200
            await answer.read()
        metrics = client.app[METRICS].exposition().decode()  # what /metrics serves (with a token)
    assert _count(metrics, "tenantgate_request_duration_seconds") == 2
    assert _count(metrics, "tenantgate_time_to_first_token_seconds") == 1
    lines = [json.loads(json_formatter().format(r)) for r in caplog.records if r.name == "tenantgate.access"]
    assert [(line["stream"], line["ttft_ms"] is None) for line in lines] == [(False, True), (True, False)]
