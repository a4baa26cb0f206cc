"""A simulated fleet and a gateway in front of it, as processes on loopback: for the demo, benchmarks and tests.

Tenant ``t`` gets API key ``key-t`` and one adapter per name given; each adapter is a directory the simulator can
load. Everything started here is stopped when the ``with`` block ends.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadtests.processes import free_port, running, sim_command

BASE_MODEL = "tiny-llama"
# Strong enough for serve (a weak admin token is refused at start: gateway/admin/auth.py).
ADMIN_TOKEN = "fleet-admin-token-0123456789abcdefghij"


def api_key(tenant: str) -> str:
    return f"key-{tenant}"


@dataclass
class RunningFleet:
    replica_urls: dict[str, str]
    gateway_url: str = ""
    gateway_pid: int = 0
    adapters: dict[str, str] = field(default_factory=dict)


def process_cpu_s(pid: int) -> float:
    """CPU seconds a process has used so far (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_adapters(root: Path, names: Sequence[str], rank: int = 8) -> dict[str, str]:
    paths = {}
    for name in names:
        directory = root / "adapters" / name
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
        paths[name] = str(directory)
    return paths


@contextlib.contextmanager
def simulated_replicas(root: Path, count: int, *sim_args: str) -> Iterator[dict[str, str]]:
    with contextlib.ExitStack() as stack:
        urls = {}
        for index in range(count):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = sim_command(port, "--model", BASE_MODEL, "--seed", str(index), *sim_args)
            stack.enter_context(running(cmd, url, root / f"sim-r{index}.log", start_timeout_s=30))
            urls[f"r{index}"] = url
        yield urls


@contextlib.contextmanager
def simulated_triton_replicas(root: Path, count: int, model: str, *sim_args: str) -> Iterator[list[dict[str, str]]]:
    """Simulated replicas in Triton mode (HTTP and gRPC ports); yields their entries for a Triton pool's config."""
    with contextlib.ExitStack() as stack:
        replicas = []
        for index in range(count):
            port, grpc_port = free_port(), free_port()
            cmd = sim_command(port, "--backend", "triton", "--grpc-port", str(grpc_port), "--model", model, *sim_args)
            url = f"http://127.0.0.1:{port}"
            log = root / f"sim-triton-t{index}.log"
            stack.enter_context(running(cmd, url, log, start_timeout_s=30, health_path="/v2/health/ready"))
            grpc = f"127.0.0.1:{grpc_port}"
            replicas.append({"id": f"t{index}", "url": url, "grpc": grpc, "metrics_url": url + "/metrics"})
        yield replicas


def triton_pool(replicas: list[dict[str, str]], model: str, base_model: str, name: str = "trt") -> dict[str, Any]:
    """A Triton pool's config over ``replicas`` (as ``simulated_triton_replicas`` yields them)."""
    return {
        "name": name,
        "backend": "triton",
        "base_model": base_model,
        "max_adapters": 2,
        "triton": {"model": model},
        "health": {"interval_s": 0.5, "timeout_s": 2.0},
        "replicas": replicas,
    }


def gateway_config(
    replica_urls: dict[str, str],
    tenants: dict[str, list[str]],
    adapters: dict[str, str],
    *,
    port: int,
    policy: str = "predicted_ttft",
    balance_factor: float = 1.25,
    max_adapters: int = 2,
    adapter_options: dict[str, dict[str, Any]] | None = None,
    tenant_options: dict[str, dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A gateway config for the fleet; ``adapter_options`` and ``tenant_options`` add fields per adapter (e.g.
    ``pinned``) and per tenant (e.g. ``limits``), ``extra`` adds top-level sections (e.g. ``state``)."""
    options, tenant_extras = adapter_options or {}, tenant_options or {}
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "routing": {"affinity": "tenant", "balance_factor": balance_factor, "vnodes": 160},
        "pools": [
            {
                "name": "llama",
                "backend": "vllm",
                "base_model": BASE_MODEL,
                "policy": policy,
                "max_adapters": max_adapters,
                "health": {"interval_s": 0.5, "timeout_s": 2.0},
                "replicas": [{"id": rid, "url": url} for rid, url in replica_urls.items()],
            }
        ],
        "adapters": [
            {"name": name, "pool": "llama", "source": path, **options.get(name, {})} for name, path in adapters.items()
        ],
        "tenants": [
            {
                "id": tenant,
                "api_keys": ["sha256:" + hashlib.sha256(api_key(tenant).encode()).hexdigest()],
                "adapters": names,
                "base_models": [BASE_MODEL],
                **tenant_extras.get(tenant, {}),
            }
            for tenant, names in tenants.items()
        ],
        **(extra or {}),
    }


@contextlib.contextmanager
def gateway_process(root: Path, config: dict[str, Any], name: str = "gateway") -> Iterator[tuple[str, int]]:
    """Run `tenantgate serve` on ``config`` until the block ends; yields its URL and pid once it is ready."""
    config_path = root / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    url = f"http://127.0.0.1:{config['listen']['port']}"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path)]
    env = {"TENANTGATE_ADMIN_TOKEN": ADMIN_TOKEN}
    with running(cmd, url, root / f"{name}.log", env=env, start_timeout_s=30, health_path="/readyz") as process:
        yield url, process.pid


@contextlib.contextmanager
def fleet_with_gateway(
    root: Path, tenants: dict[str, list[str]], replicas: int, sim_args: Sequence[str], **config_args: Any
) -> Iterator[RunningFleet]:
    adapters = write_adapters(root, sorted({name for names in tenants.values() for name in names}))
    with simulated_replicas(root, replicas, *sim_args) as urls:
        config = gateway_config(urls, tenants, adapters, port=free_port(), **config_args)
        with gateway_process(root, config) as (gateway_url, pid):
            yield RunningFleet(urls, gateway_url, pid, adapters)


def sim_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/sim/stats", timeout=10) as response:
        stats: dict[str, Any] = json.load(response)
        return stats
