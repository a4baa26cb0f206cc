"""Engines by registration (backends/registry.py): the config's `backend`, engine sections and replica keys are
the registered specs' to validate; a module named in `engines:` registers one more, also in a gateway started as
a process (tests/support/echo_engine.py, an engine only the tests ship)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from backends import registry
from backends.registry import EngineSpec, NoSettings
from backends.triton import TritonDriver
from backends.vllm import VllmDriver
from gateway.config import ConfigError, GatewayConfig, parse_config
from gateway.fleet.engines import endpoint, make_driver
from gateway.observe.metrics import GatewayMetrics
from loadtests.fleet import (
    ADMIN_TOKEN,
    api_key,
    gateway_config,
    gateway_process,
    simulated_replicas,
    triton_pool,
    write_adapters,
)
from loadtests.processes import free_port
from tests.support.echo_engine import EchoDriver, EchoEndpoint, EchoSettings

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[3]
ECHO = "tests.support.echo_engine"
CONFIG_FILES = sorted([*REPO.glob("deploy/examples/*.yaml"), *REPO.glob("deploy/k8s/overlays/*/gateway.yaml")])


def written_configs() -> dict[str, dict[str, Any]]:
    """The configs tests and load tests write: a vLLM pool, and a Triton pool beside it with its own keys."""
    vllm = gateway_config({"r0": "http://127.0.0.1:9001"}, {"acme": ["a"]}, {"a": "/srv/a"}, port=8080)
    mixed = gateway_config({"r0": "http://127.0.0.1:9001"}, {"acme": ["a"]}, {"a": "/srv/a"}, port=8080)
    replicas = [{"id": "t0", "url": "http://127.0.0.1:9101", "grpc": "127.0.0.1:9102", "metrics_url": "http://x/m"}]
    mixed["pools"].append(triton_pool(replicas, "tensorrt_llm_bls", "trt-base"))
    return {"vllm": vllm, "mixed": mixed}


def echo_config(**echo: Any) -> dict[str, Any]:
    config = gateway_config({"r0": "http://127.0.0.1:9001"}, {"acme": ["a"]}, {"a": "/srv/a"}, port=8080)
    config["engines"] = [ECHO]
    config["pools"][0] |= {"backend": "echo", "echo": echo}
    return config


def problems(config: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(yaml.safe_dump(config))
    return caught.value.problems


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[str(p.relative_to(REPO)) for p in CONFIG_FILES])
def test_every_config_file_parses_unchanged_and_dumps_as_written(path: Path) -> None:
    config = parse_config(path.read_text(), str(path))
    # The fleet rebuilds configs from their dump (discovery, the tenant registry): engine keys must survive it.
    assert GatewayConfig.model_validate(config.model_dump()) == config
    assert GatewayConfig.model_validate_json(config.model_dump_json()) == config


@pytest.mark.parametrize("name", ["vllm", "mixed"])
def test_the_configs_tests_write_parse_and_round_trip(name: str) -> None:
    written = written_configs()[name]
    config = GatewayConfig.model_validate(written)
    dumped = config.model_dump(mode="json")
    assert GatewayConfig.model_validate(dumped) == config
    for pool, raw in zip(dumped["pools"], written["pools"], strict=True):
        assert ("triton" in pool) == ("triton" in raw)  # the section under the engine's name, as written
        for replica, raw_replica in zip(pool["replicas"], raw["replicas"], strict=True):
            assert {key for key, value in replica.items() if value is not None} == set(raw_replica)


async def test_the_built_in_engines_are_always_registered() -> None:
    assert {"vllm", "triton"} <= set(registry.names())
    config = GatewayConfig.model_validate(written_configs()["mixed"])
    drivers = [make_driver(pool, GatewayMetrics()) for pool in config.pools]
    assert [type(driver) for driver in drivers] == [VllmDriver, TritonDriver]
    for driver in drivers:
        await driver.close()


def test_an_unknown_backend_names_the_registered_engines() -> None:
    config = written_configs()["vllm"]
    config["pools"][0]["backend"] = "sglang"
    [problem] = problems(config)
    assert problem.startswith("pools.0.backend: unknown engine 'sglang'; registered engines: ")
    assert "triton" in problem and "vllm" in problem and "`engines:`" in problem


def test_an_engine_module_that_cannot_be_imported_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_engine.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = echo_config()
    config["engines"] = ["tests.support.no_such_engine", "broken_engine", "not a module"]
    assert problems(config) == [
        "engines.0: cannot import engine module 'tests.support.no_such_engine': "
        "ModuleNotFoundError: No module named 'tests.support.no_such_engine'",
        "engines.1: cannot import engine module 'broken_engine': RuntimeError: no GPU here",
        "engines.2: not a module name (dotted, as in `mycompany.sglang_engine`)",
    ]


def test_settings_for_another_engine_are_refused() -> None:
    on_vllm = written_configs()["vllm"]
    on_vllm["engines"] = [ECHO]
    on_vllm["pools"][0]["echo"] = {"reply_prefix": "x"}
    assert problems(on_vllm) == ["pools.0.echo: `echo` settings on a vllm pool"]
    on_echo = echo_config()
    on_echo["pools"][0]["triton"] = {"model": "ensemble"}
    on_echo["pools"][0]["replicas"][0] |= {"grpc": "127.0.0.1:1", "colour": "blue"}
    assert problems(on_echo) == [
        "pools.0.triton: `triton` settings on an echo pool",
        "pools.0.replicas.0.grpc: replica `grpc` is for triton pools, not echo",
        "pools.0.replicas.0.colour: Extra inputs are not permitted",  # the echo replica model's own verdict
    ]
    bad_section = echo_config(reply_prefix="x", fingerprint="", colour="blue")
    bad_section["pools"][0]["replicas"][0]["url"] = "not a url"
    assert sorted(problems(bad_section)) == [
        "pools.0.echo.colour: Extra inputs are not permitted",
        "pools.0.echo.fingerprint: String should have at least 1 character",
        "pools.0.replicas.0.url: Input should be a valid URL, relative URL without a base",  # reported with them
    ]


def test_the_internal_settings_field_is_not_a_config_key() -> None:
    config = written_configs()["vllm"]
    config["pools"][0]["settings"] = {}
    config["pools"][0]["replicas"][0]["extras"] = {}
    assert problems(config) == [
        "pools.0.settings: Extra inputs are not permitted",
        "pools.0.replicas.0.extras: Extra inputs are not permitted",
    ]


async def test_a_registered_engine_gets_its_section_endpoint_and_driver() -> None:
    raw = echo_config(reply_prefix=">> ", fingerprint="fp")
    raw["pools"][0]["replicas"][0]["tag"] = "blue"
    config = GatewayConfig.model_validate(raw)
    pool = config.pools[0]
    assert pool.settings == EchoSettings(reply_prefix=">> ", fingerprint="fp")
    assert endpoint(pool, pool.replicas[0]) == EchoEndpoint("r0", "http://127.0.0.1:9001", "blue")
    driver = make_driver(pool, GatewayMetrics())
    assert isinstance(driver, EchoDriver)
    await driver.close()
    dumped = config.model_dump(mode="json")
    assert dumped["pools"][0]["echo"] == {"reply_prefix": ">> ", "fingerprint": "fp"}
    assert dumped["pools"][0]["replicas"][0]["tag"] == "blue"
    assert GatewayConfig.model_validate(dumped) == config


def test_an_engines_own_checks_run_with_the_config() -> None:
    config = echo_config()
    config["adapters"][0]["source"] = "relative/a"
    [problem] = problems(config)
    assert "adapter 'a' of echo pool 'llama': source 'relative/a' is not an absolute path" in problem


def test_a_taken_engine_name_cannot_be_registered_again() -> None:
    vllm = registry.spec("vllm")
    assert registry.register(vllm) is vllm  # the same spec again: a no-op
    with pytest.raises(ValueError, match="engine 'vllm' is already registered"):
        registry.register(EngineSpec(name="vllm", settings=NoSettings, driver=EchoDriver))
    assert registry.spec("vllm") is vllm


def test_an_engine_named_like_a_pool_key_is_refused_where_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._specs, "health", EngineSpec(name="health", settings=NoSettings, driver=EchoDriver))
    config = written_configs()["vllm"]
    assert GatewayConfig.model_validate(config).pools[0].health.interval_s == 0.5  # other pools' `health` untouched
    config["pools"][0]["backend"] = "health"
    assert problems(config) == ["pools.0.backend: engine 'health' cannot have a section: its name is a pool key"]


def test_check_config_imports_the_engines_it_names(tmp_path: Path) -> None:
    path = tmp_path / "echo.yaml"
    path.write_text(yaml.safe_dump(echo_config(reply_prefix="x")))
    command = [sys.executable, "-m", "gateway.cli", "check-config", str(path)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert ok.returncode == 0, ok.stderr
    path.write_text(yaml.safe_dump({**echo_config(), "engines": []}))
    refused = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert refused.returncode == 1 and "pools.0.backend: unknown engine 'echo'" in refused.stderr


def test_a_gateway_process_serves_through_an_engine_its_config_registers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    adapters = write_adapters(tmp_path, ["echo-a"])
    with simulated_replicas(tmp_path, 2, "--time-scale", "0.01", "--max-loras", "2") as urls:
        config = gateway_config(urls, {"acme": ["echo-a"]}, adapters, port=free_port(), extra={"engines": [ECHO]})
        pool = config["pools"][0]
        pool |= {"backend": "echo", "echo": {"reply_prefix": "[echo] ", "fingerprint": "echo-e2e"}}
        for replica in pool["replicas"]:
            replica["tag"] = f"tag-{replica['id']}"
        with gateway_process(tmp_path, config) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key=api_key("acme"), max_retries=0, timeout=30)
            answer = client.chat.completions.create(
                model="echo-a", messages=[{"role": "user", "content": "hello there"}], max_tokens=6
            )
            route = httpx.get(url + "/admin/route?tenant=acme", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
            home = route.json()["home"]
        body = {"model": "echo-a", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6}
        direct = httpx.post(urls[home] + "/v1/chat/completions", json=body, timeout=30).json()
    # Served by the echo driver: its prefix before the replica's own answer, its fingerprint with the home's tag.
    assert answer.system_fingerprint == f"echo-e2e:tag-{home}"
    assert answer.choices[0].message.content == "[echo] " + direct["choices"][0]["message"]["content"]
