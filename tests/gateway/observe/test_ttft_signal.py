"""tenantgate_time_to_first_token_seconds measures what its name says: a stream's first chunk. A whole answer's
first byte is its last, so non-streamed requests count only in tenantgate_request_duration_seconds (and their
access-log line has no ttft_ms)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import create_app
from gateway.appkeys import METRICS
from gateway.config import GatewayConfig
from gateway.observe.logs import json_formatter
from loadtests.fleet import api_key, gateway_config
from loadtests.processes import free_port, running, sim_command
from tests.servers import BASE_MODEL, EngineProcess, write_adapter


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


async def test_each_stream_is_counted_by_the_regime_it_met(tmp_path: Path) -> None:
    """tenantgate_stream_regimes_total: predicted_ttft's streams by tenant, replica and the regime each met (cold:
    it waited for its adapter's load); a whole answer is not counted. A replica of its own (nothing registered) and
    one adapter slot, filled with a1 at start-up: a2's first stream loads it (cold), its second finds it resident."""
    adapters = {name: str(write_adapter(tmp_path / name, 8)) for name in ("a1", "a2")}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = sim_command(port, "--model", BASE_MODEL, "--max-loras", "1", "--max-cpu-loras", "1", "--time-scale", "0.01")
    with running(cmd, url, tmp_path / "sim.log", start_timeout_s=30):
        raw: dict[str, Any] = gateway_config({"r0": url}, {"acme": ["a1", "a2"]}, adapters, port=0, max_adapters=1)
        async with TestClient(TestServer(create_app(GatewayConfig.model_validate(raw)))) as client:
            auth = {"Authorization": f"Bearer {api_key('acme')}"}
            for stream in (True, True, False):
                body = {"model": "a2", "prompt": "x", "max_tokens": 3, "stream": stream}
                answer = await client.post("/v1/completions", json=body, headers=auth)
                assert answer.status == 200
                await answer.read()
            metrics = client.app[METRICS].exposition().decode()
    pattern = r'^tenantgate_stream_regimes_total\{pool="llama",regime="(\w+)",replica="r0",tenant="acme"\} (\S+)$'
    counted = dict(re.findall(pattern, metrics, re.MULTILINE))
    assert counted.pop("cold") == "1.0"
    assert list(counted.values()) == ["1.0"] and set(counted) <= {"warm", "kv_cold", "host"}
