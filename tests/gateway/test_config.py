from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, ReplicaConfig, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "examples" / "gateway.yaml"


def test_the_documented_example_is_accepted_as_written() -> None:
    config = load_config(EXAMPLE)
    assert [r.id for r in config.pools[0].replicas] == ["r0", "r1", "r2"]
    assert config.routing.balance_factor == 1.25
    assert config.pools[0].policy == "predicted_ttft"


def _with(replace: str, by: str) -> str:
    text = EXAMPLE.read_text()
    assert replace in text
    return text.replace(replace, by)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(_with("vnodes: 160", "vnodes: 160\n  colour: blue"), "routing.colour: Extra inputs",
                     id="unknown-key"),
        # A tenant's session keys share its adapter: traffic homes would count a slot per session, and a tenant
        # splitting its demand over sessions took its neighbours' slots (test_plan.py).
        pytest.param(_with("affinity: tenant ", "affinity: session ").replace("ment: balanced", "ment: traffic"),
                     "home_placement: traffic cannot be used with affinity: session", id="session-traffic-homes"),
        pytest.param(_with("balance_factor: 1.25", "balance_factor: 0.5"), "routing.balance_factor", id="factor<1"),
        pytest.param(_with("pool: llama, source: /srv/loras/sql", "pool: nope, source: /srv/loras/sql"),
                     "names unknown pool 'nope'", id="unknown-pool"),
        pytest.param(_with("adapters: [sql-globex]", "adapters: [sql-initech]"),
                     "tenant 'globex' names unknown adapter 'sql-initech'", id="unknown-adapter"),
        pytest.param(_with("backend: vllm", "backend: tgi"), "pools.0.backend", id="unknown-backend"),
        pytest.param(_with("id: r1,", "id: r0,"), "duplicate replica id", id="duplicate-replica"),
        pytest.param(_with('url: "http://127.0.0.1:9002"', 'url: "not a url"'), "pools.0.replicas.1.url",
                     id="bad-url"),
        pytest.param(_with('api_keys: ["sha256:b8', 'api_keys: ["plaintext-b8'), "tenants.0.api_keys.0",
                     id="key-not-hash"),
        pytest.param("listen: [", "not valid YAML", id="bad-yaml"),
        # Two catalog adapters under one engine name would share weights across tenants.
        pytest.param(_with("sql-globex}", "sql-globex, engine_name: support-acme}"),
                     "engine_name 'support-acme', another adapter's name", id="engine-name-borrowed"),
        pytest.param(_with("sql-globex}", "sql-globex, engine_name: shared}").replace(
                         "loras/support-acme}", "loras/support-acme, engine_name: shared}"),
                     "engine name 'shared' is used by more than one adapter", id="engine-name-shared"),
    ],
)  # fmt: skip
def test_invalid_configs_name_the_offending_field(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert any(expected in problem for problem in caught.value.problems), caught.value.problems


def test_check_config_cli(tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check-config", str(EXAMPLE)], capture_output=True, text=True
    )
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(_with("vnodes: 160", "vnodes: 0\n  colour: blue"))
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "check-config", str(bad)], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "routing.vnodes" in result.stderr and "routing.colour" in result.stderr  # every error, not the first


def test_config_is_frozen() -> None:
    config = load_config(EXAMPLE)
    with pytest.raises(ValueError):
        config.routing.vnodes = 3


TRITON_POOL = """
  - name: trt
    backend: triton
    base_model: trt-base
    triton: {model: tensorrt_llm_bls, lora_dtype: bfloat16}
    replicas:
      - {id: t0, url: "http://10.0.0.5:8000"}
      - {id: t1, url: "http://10.0.0.6:9000", grpc: "10.0.0.6:9001", metrics_url: "http://10.0.0.6:9002/metrics"}
"""


def _with_triton_pool(extra_adapters: str = "") -> str:
    text = _with("pools:\n", "pools:" + TRITON_POOL)
    return text.replace("adapters:\n", "adapters:\n" + extra_adapters, 1) if extra_adapters else text


def test_a_triton_pool_beside_a_vllm_pool() -> None:
    from backends.triton_config import TritonConfig, TritonEndpoint
    from gateway.fleet.engines import endpoint

    config = parse_config(_with_triton_pool())
    pool = config.pools_by_name["trt"]
    assert pool.backend == "triton" and isinstance(pool.settings, TritonConfig)
    assert pool.settings.model == "tensorrt_llm_bls"
    assert pool.settings.lora_dtype == "bfloat16" and pool.settings.default_max_tokens == 1024
    derived, explicit = (endpoint(pool, replica) for replica in pool.replicas)
    assert isinstance(derived, TritonEndpoint) and isinstance(explicit, TritonEndpoint)
    assert (derived.grpc_address, derived.metrics_url) == ("10.0.0.5:8001", "http://10.0.0.5:8002/metrics")
    assert (explicit.grpc_address, explicit.metrics_url) == ("10.0.0.6:9001", "http://10.0.0.6:9002/metrics")
    v6 = endpoint(pool, ReplicaConfig.model_validate({"id": "t6", "url": "http://[::1]:8000"}))
    assert isinstance(v6, TritonEndpoint)
    assert (v6.grpc_address, v6.metrics_url) == ("[::1]:8001", "http://[::1]:8002/metrics")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(_with("backend: vllm", "backend: vllm\n    triton: {model: x}"), "`triton` settings on a vllm",
                     id="triton-settings-on-vllm"),
        pytest.param(_with('url: "http://127.0.0.1:9002"', 'url: "http://127.0.0.1:9002", grpc: "127.0.0.1:1"'),
                     "replica `grpc` is for triton pools", id="grpc-on-vllm"),
        pytest.param(_with_triton_pool().replace("lora_dtype: bfloat16", "lora_dtype: int4"), "lora_dtype",
                     id="bad-dtype"),
        pytest.param(_with_triton_pool().replace("lora_dtype: bfloat16", 'chat_template: "{% for %}"'),
                     "chat_template is not valid Jinja", id="bad-template"),
        pytest.param(_with_triton_pool().replace('grpc: "10.0.0.6:9001"', 'grpc: "10.0.0.6"'), "grpc",
                     id="grpc-without-port"),
        pytest.param(_with_triton_pool().replace('grpc: "10.0.0.6:9001"', 'grpc: "10.0.0.6:99999"'),
                     "between 1 and 65535", id="grpc-port-range"),
    ],
)  # fmt: skip
def test_triton_settings_are_validated(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert any(expected in problem for problem in caught.value.problems), caught.value.problems


def test_adapters_whose_task_ids_collide_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from backends import triton_config

    monkeypatch.setattr(triton_config, "task_id", lambda name, source: 42)  # a 63-bit collision, made to happen
    text = _with_triton_pool("  - {name: t-a, pool: trt, source: /a}\n  - {name: t-b, pool: trt, source: /b}\n")
    with pytest.raises(ConfigError) as caught:
        parse_config(text)
    assert any("['t-a', 't-b'] of pool 'trt' share lora_task_id 42" in p for p in caught.value.problems)


def test_check_config_reads_triton_adapters_when_asked(tmp_path: Path) -> None:
    from loadtests.peft_files import write_peft_adapter

    good = write_peft_adapter(tmp_path / "good", 4)
    config = tmp_path / "mixed.yaml"
    config.write_text(
        _with_triton_pool(
            f"  - {{name: t-good, pool: trt, source: {good}}}\n  - {{name: t-bad, pool: trt, source: /nope}}\n"
        )
    )
    command = [sys.executable, "-m", "gateway.cli", "check-config", str(config)]
    assert subprocess.run(command, capture_output=True, text=True).returncode == 0
    result = subprocess.run([*command, "--read-adapters"], capture_output=True, text=True)
    assert result.returncode == 1
    assert "adapter 't-bad': no adapter_config.json in /nope" in result.stderr
    assert "t-good" not in result.stderr
