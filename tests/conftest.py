from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from loadtests.processes import free_port, running, sim_command
from tests.redis_cluster import RedisCluster
from tests.redis_server import RedisServer
from tests.servers import (
    BASE_MODEL,
    TINY_MODEL_DIR,
    VLLM_PYTHON,
    EngineProcess,
    TritonProcess,
    engines_required,
    vllm_command,
    write_adapter,
)

# No per-example deadline for property tests: hypothesis fails an example that takes over 200 ms, which on a busy
# machine is a timing assertion (test_usage_fast_paths failed so at load 15). Speed is measured by benchmarks.
settings.register_profile("tenantgate", deadline=None)
settings.load_profile("tenantgate")

PRELOADED = ("a1", "a2")


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """A real three-master Redis Cluster (with a replica each) for the session; tests keep to their own prefixes."""
    with RedisCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_server_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the session; tests take it through ``redis_server``."""
    with RedisServer(log_path=tmp_path_factory.mktemp("redis") / "redis.log") as server:
        yield server


@pytest.fixture
def redis_server(redis_server_process: RedisServer) -> RedisServer:
    """The session's redis-server, empty for this test (FLUSHALL; started again if a test killed it). Gateway
    processes use the default key prefix and channels, so without it a test would find what an earlier one left:
    residency records of replicas with the same ids, rate buckets, registry entries, gateways' heartbeats. A test
    that kills the server starts its own instead."""
    redis_server_process.start()
    redis_server_process.flush()
    return redis_server_process


def _missing_engine(what: str) -> None:
    message = f"{what} is not built: run `make engines` (make test does)"
    if engines_required():
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def sim_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """A simulated replica with the same adapters and limits as the real vLLM lane, running fast."""
    root = tmp_path_factory.mktemp("sim-adapters")
    adapters = {name: str(write_adapter(root / name, 8)) for name in ("a1", "a2", "a3", "a4")}
    adapters["big-rank"] = str(write_adapter(root / "big-rank", 16))
    port = free_port()
    cmd = sim_command(
        port, "--model", BASE_MODEL, "--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "8",
        "--max-model-len", "512", "--time-scale", "0.01",
        "--lora-modules", *(f"{name}={adapters[name]}" for name in PRELOADED),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    log = root / "sim.log"
    with running(cmd, url, log, start_timeout_s=30):
        yield EngineProcess("sim", url, BASE_MODEL, adapters, log)


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """A real vLLM (CPU build) on the locally made tiny model, pinned to core 0."""
    if not VLLM_PYTHON.exists():
        _missing_engine(f"the vLLM engine venv ({VLLM_PYTHON})")
    if not (TINY_MODEL_DIR / "model").exists():
        _missing_engine(f"the tiny model ({TINY_MODEL_DIR})")
    adapter_root = TINY_MODEL_DIR / "adapters"
    adapters = {name: str(adapter_root / name) for name in ("a1", "a2", "a3", "a4", "big-rank")}
    port = free_port()
    cmd, env = vllm_command(port, {name: adapters[name] for name in PRELOADED})
    url = f"http://127.0.0.1:{port}"
    log = Path(tmp_path_factory.mktemp("vllm")) / "vllm.log"
    with running(cmd, url, log, env=env, start_timeout_s=240):
        yield EngineProcess("vllm", url, BASE_MODEL, adapters, log)


@pytest.fixture(params=["sim", pytest.param("vllm", marks=pytest.mark.engine)])
def engine(request: pytest.FixtureRequest) -> EngineProcess:
    """Each conformance test runs against the simulator and against a real vLLM server."""
    fixture: EngineProcess = request.getfixturevalue(f"{request.param}_engine")
    return fixture


@pytest.fixture(scope="session")
def sim_triton_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProcess]:
    """The simulator in Triton mode (KServe v2 gRPC + HTTP, the TensorRT-LLM LoRA contract of docs/triton.md)."""
    from tests.engines.triton_sim import running_sim_triton

    with running_sim_triton(tmp_path_factory.mktemp("sim-triton")) as engine:
        yield engine


@pytest.fixture(scope="session")
def triton_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProcess]:
    """A real Triton Inference Server (from the nvidia-pytriton wheel, native mode) with this repo's Python-backend
    model that follows the TensorRT-LLM I/O and LoRA contract."""
    from tests.engines.triton_real import running_triton

    with running_triton(tmp_path_factory.mktemp("triton")) as engine:
        yield engine


@pytest.fixture(params=["sim_triton", pytest.param("triton", marks=pytest.mark.engine)])
def triton_lane(request: pytest.FixtureRequest) -> TritonProcess:
    """Each Triton conformance test runs against the simulator's Triton mode and against a real Triton server."""
    fixture: TritonProcess = request.getfixturevalue(f"{request.param}_engine")
    return fixture
