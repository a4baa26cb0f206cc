"""Where the test engines live and how they are started (the simulator, a real vLLM)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENGINES_DIR = Path(os.environ.get("TENANTGATE_ENGINES_DIR", REPO / ".engines"))
VLLM_PYTHON = ENGINES_DIR / "vllm" / "bin" / "python"
TINY_MODEL_DIR = ENGINES_DIR / "tiny"
BASE_MODEL = "tiny-llama"


def engines_required() -> bool:
    """`make test` sets this: a missing engine is then a failure, not a skip."""
    return os.environ.get("TENANTGATE_REQUIRE_ENGINES") == "1"


def debian_tool(binary: str, make_target: str) -> str:
    """A tool `make test` installs from Debian: its path, else a failure under `make test` and a skip elsewhere."""
    path = shutil.which(binary)
    if path is None:
        message = f"{binary} is not on PATH: run `make {make_target}` (make test does), or apt-get install it"
        if engines_required():
            pytest.fail(message)
        pytest.skip(message)
    return path


def write_adapter(directory: Path, rank: int) -> Path:
    """A PEFT adapter directory as far as the simulator reads it (only adapter_config.json)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": rank, "peft_type": "LORA"}))
    return directory


@dataclass
class EngineProcess:
    name: str
    url: str
    base_model: str
    adapters: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None


@dataclass
class TritonProcess:
    """A Triton-protocol replica under test: a real Triton server or the simulator's Triton mode."""

    name: str
    http_url: str
    grpc_address: str  # host:port
    metrics_url: str
    model: str  # the Triton model serving the TensorRT-LLM contract (docs/triton.md)
    adapters: dict[str, str] = field(default_factory=dict)  # name -> PEFT directory with real weights
    log_path: Path | None = None


def vllm_command(port: int, lora_modules: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The real vLLM CPU server on the tiny model, with the flags docs/engines-on-cpu.md gives."""
    cmd = [
        str(VLLM_PYTHON), str(REPO / "tests" / "engines" / "vllm_launcher.py"), "serve", str(TINY_MODEL_DIR / "model"),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", BASE_MODEL, "--dtype", "bfloat16",
        "--max-model-len", "512", "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(64 * 1024 * 1024),
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--max-cpu-loras", "4",
        "--lora-modules", *(f"{name}={path}" for name, path in lora_modules.items()),
    ]  # fmt: skip
    env = {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    return cmd, env
