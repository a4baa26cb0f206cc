"""The simulator in Triton mode as a test engine: the same limits as the real Triton lane (a two-adapter PEFT
cache, rank 8 at most) and PEFT adapters with real weights, running fast."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loadtests.peft_files import write_peft_adapter
from loadtests.processes import free_port, running, sim_command
from tests.servers import TritonProcess

MODEL = "tensorrt_llm_bls"


@contextmanager
def running_sim_triton(tmp_dir: Path) -> Iterator[TritonProcess]:
    """``tenantgate sim --backend triton`` on free loopback ports until the block ends."""
    adapters = {name: write_peft_adapter(tmp_dir / name, 8, seed=i) for i, name in enumerate(("a1", "a2", "a3", "a4"))}
    adapters["big-rank"] = write_peft_adapter(tmp_dir / "big-rank", 16, seed=4)
    port, grpc_port = free_port(), free_port()
    cmd = sim_command(
        port, "--backend", "triton", "--grpc-port", str(grpc_port), "--model", MODEL, "--max-loras", "2",
        "--max-cpu-loras", "2", "--max-lora-rank", "8", "--max-model-len", "512", "--time-scale", "0.01",
    )  # fmt: skip
    http_url = f"http://127.0.0.1:{port}"
    log = tmp_dir / "sim-triton.log"
    with running(cmd, http_url, log, start_timeout_s=30, health_path="/v2/health/ready"):
        yield TritonProcess(
            name="sim_triton",
            http_url=http_url,
            grpc_address=f"127.0.0.1:{grpc_port}",
            metrics_url=f"{http_url}/metrics",
            model=MODEL,
            adapters={name: str(path) for name, path in adapters.items()},
            log_path=log,
        )
