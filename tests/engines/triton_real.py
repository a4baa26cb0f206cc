"""A real Triton Inference Server (from the nvidia-pytriton wheel, run natively) serving this repo's Python-backend
stand-in for TensorRT-LLM's `tensorrt_llm_bls`, with the flags and environment docs/engines-on-cpu.md gives."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from loadtests.processes import free_port, running
from tests.servers import ENGINES_DIR, REPO, TINY_MODEL_DIR, TritonProcess, engines_required

TRITON_VENV = ENGINES_DIR / "triton"
TRITON_PYTHON = TRITON_VENV / "bin" / "python"
MODEL_REPOSITORY = REPO / "tests" / "engines" / "triton_model"
MODEL = "tensorrt_llm_bls"
ADAPTERS = ("a1", "a2", "a3", "a4", "big-rank")


def _missing_engine(what: str) -> None:
    message = f"{what} is not built: run `make engines` (make test does)"
    if engines_required():
        pytest.fail(message)
    pytest.skip(message)


def _interpreter() -> dict[str, str]:
    """The Triton venv's Python: its version (picks the backend stub), LIBDIR and site-packages."""
    script = (
        "import json, sys, sysconfig; print(json.dumps({'version': f'{sys.version_info[0]}.{sys.version_info[1]}',"
        " 'libdir': sysconfig.get_config_var('LIBDIR'), 'purelib': sysconfig.get_paths()['purelib']}))"
    )
    info: dict[str, str] = json.loads(subprocess.check_output([str(TRITON_PYTHON), "-c", script], text=True))
    return info


def _backend_directory(site_packages: Path, version: str, target: Path) -> Path:
    """Triton looks for `<dir>/python/libtriton_python.so` and the stub beside it; the wheel keeps them apart."""
    server = site_packages / "pytriton" / "tritonserver"
    python = target / "python"
    python.mkdir(parents=True)
    for source in (
        server / "backends" / "python" / "libtriton_python.so",
        server / "backends" / "python" / "triton_python_backend_utils.py",
        server / "python_backend_stubs" / version / "triton_python_backend_stub",
    ):
        shutil.copy2(source, python / source.name)
    return target


def _set_parameters(config: Path, parameters: dict[str, str]) -> None:
    text = config.read_text()
    for key, value in parameters.items():
        text, found = re.subn(rf'(key: "{re.escape(key)}", value: {{ string_value: )"[^"]*"', rf'\g<1>"{value}"', text)
        if not found:
            raise KeyError(f"{config} has no parameter {key}")
    config.write_text(text)


@contextmanager
def running_triton(tmp_dir: Path, parameters: dict[str, str] | None = None) -> Iterator[TritonProcess]:
    """tritonserver on free loopback ports with a copy of the model repository (``parameters`` override its
    config.pbtxt's, e.g. {"lora_cache_max_adapters": "4"}); stopped when the block ends."""
    if not TRITON_PYTHON.exists():
        _missing_engine(f"the Triton engine venv ({TRITON_VENV})")
    if not (TINY_MODEL_DIR / "adapters").exists():
        _missing_engine(f"the tiny model ({TINY_MODEL_DIR})")
    interpreter = _interpreter()
    site_packages = Path(interpreter["purelib"])
    models = tmp_dir / "models"
    shutil.copytree(MODEL_REPOSITORY, models, ignore=shutil.ignore_patterns("__pycache__"))
    _set_parameters(models / MODEL / "config.pbtxt", parameters or {})
    backends = _backend_directory(site_packages, interpreter["version"], tmp_dir / "backends")

    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    cmd = [
        str(site_packages / "pytriton" / "tritonserver" / "bin" / "tritonserver"),
        f"--model-repository={models}", f"--backend-directory={backends}",
        "--model-control-mode=explicit", "--load-model=*",
        "--http-address=127.0.0.1", f"--http-port={http_port}",
        "--grpc-address=127.0.0.1", f"--grpc-port={grpc_port}",
        "--metrics-address=127.0.0.1", f"--metrics-port={metrics_port}",
        "--allow-gpu-metrics=false", "--strict-readiness=true", "--exit-timeout-secs=5",
    ]  # fmt: skip
    # The interpreter's own libpython first (else the stub loads the system one against this stdlib), then the
    # wheel's libraries (copied .so files lose their $ORIGIN rpath); the venv's bin first so the stub finds numpy.
    library_path = [interpreter["libdir"], str(site_packages / "nvidia_pytriton.libs")]
    env = {
        "LD_LIBRARY_PATH": os.pathsep.join([*library_path, os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep),
        "PATH": os.pathsep.join([str(TRITON_VENV / "bin"), os.environ.get("PATH", "")]),
    }
    http_url = f"http://127.0.0.1:{http_port}"
    log = tmp_dir / "triton.log"
    with running(cmd, http_url, log, env=env, start_timeout_s=60, health_path="/v2/health/ready"):
        yield TritonProcess(
            name="triton",
            http_url=http_url,
            grpc_address=f"127.0.0.1:{grpc_port}",
            metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
            model=MODEL,
            adapters={name: str(TINY_MODEL_DIR / "adapters" / name) for name in ADAPTERS},
            log_path=log,
        )
