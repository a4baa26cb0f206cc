"""Every line `tenantgate serve` writes is one JSON object: start-up, the access log, warnings, a refused reload,
shutdown. The whole log of a gateway process that lived through each is parsed, line by line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from loadtests.fleet import api_key, gateway_config
from loadtests.processes import free_port, running
from tests.servers import EngineProcess


def _parsed(log: Path) -> list[dict[str, Any]]:
    lines = log.read_text().splitlines()
    assert lines, "the gateway wrote nothing"
    objects = []
    for number, line in enumerate(lines, 1):
        try:
            parsed = json.loads(line)
        except ValueError as exc:
            raise AssertionError(f"line {number} is not JSON: {line!r}") from exc
        assert isinstance(parsed, dict), line
        assert {"time", "level", "logger", "message"} <= parsed.keys(), line
        objects.append(parsed)
    return objects


def test_every_line_of_the_gateways_log_is_one_json_object(sim_engine: EngineProcess, tmp_path: Path) -> None:
    port = free_port()
    nowhere = f"http://127.0.0.1:{free_port()}"  # a replica that never answers: probe warnings
    config = gateway_config(
        {"r0": sim_engine.url, "r1": nowhere}, {"acme": ["a1"]}, {"a1": sim_engine.adapters["a1"]}, port=port
    )
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    log = tmp_path / "gateway.log"
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)]
    env = {"TENANTGATE_ADMIN_TOKEN": "json-logs-test-admin-token-0123456789"}
    with running(cmd, url, log, env=env, start_timeout_s=60, health_path="/readyz") as process:
        auth = {"Authorization": f"Bearer {api_key('acme')}"}
        body = {"model": "a1", "prompt": "x", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=30).status_code == 200
        assert httpx.post(url + "/v1/completions", json={**body, "model": "nope"}, headers=auth).status_code == 404
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401
        path.write_text("pools: [")  # a reload that is refused: logged as an error
        os.kill(process.pid, signal.SIGHUP)
        deadline = time.monotonic() + 20
        while "reload refused" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
    objects = _parsed(log)  # after SIGTERM: the shutdown lines are in too
    access = [o for o in objects if o["logger"] == "tenantgate.access"]
    assert [o["status"] for o in access] == [200, 404, 401]
    assert access[0]["tenant"] == "acme" and access[0]["replica"] == "r0" and access[0]["reasons"] == ["home"]
    assert any(o["level"] == "ERROR" and "reload refused" in o["message"] for o in objects)
    assert any(o["level"] == "WARNING" for o in objects)
    assert objects[-1]["message"] == "shut down"


def test_a_config_that_does_not_load_is_logged_as_json_too(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("routing: {vnodes: 0}\n")
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    [line] = [json.loads(line) for line in result.stderr.splitlines()]
    assert line["level"] == "ERROR" and any(p.startswith("routing.vnodes") for p in line["problems"]), line
