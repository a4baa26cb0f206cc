"""Start server processes (simulated replicas, engines, gateways) on loopback and stop them whatever happens."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def healthy(url: str, path: str = "/health") -> bool:
    try:
        with urllib.request.urlopen(url + path, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def sim_command(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", "sim", "--port", str(port), *args]


@contextmanager
def running(
    cmd: Sequence[str],
    url: str,
    log_path: Path,
    env: dict[str, str] | None = None,
    start_timeout_s: float = 120,
    health_path: str = "/health",
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` until the block ends, once ``url + health_path`` answers 200; its output goes to ``log_path``."""
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            list(cmd), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
        )
        try:
            deadline = time.monotonic() + start_timeout_s
            while not healthy(url, health_path):
                if process.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{cmd[0]} did not become healthy at {url}:\n{tail}")
                time.sleep(0.25)
            yield process
        finally:
            stop(process)


def stop(process: subprocess.Popen[bytes], timeout_s: float = 15) -> None:
    """SIGTERM the process group, then SIGKILL it if it has not gone within ``timeout_s``."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=5)
