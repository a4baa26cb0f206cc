"""A real redis-server on loopback for the tests, which can be killed and brought back on the same port."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from loadtests.processes import free_port
from tests.servers import debian_tool


def redis_server_binary() -> str:
    return debian_tool("redis-server", "redis")


def answers_ping(port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """``start()`` runs redis-server (no persistence) on ``port`` until it answers PING; ``stop()`` kills it.

    Both can be called again: the server comes back, empty, on the same port and URL. Its output goes to
    ``log_path`` (appended across restarts).
    """

    def __init__(self, port: int | None = None, log_path: Path | None = None, start_timeout_s: float = 10) -> None:
        self.port = port if port is not None else free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"tenantgate-redis-{self.port}.log"
        self._start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        if self._process is not None:
            return self
        cmd = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no",
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._process = process
        deadline = time.monotonic() + self._start_timeout_s
        while not answers_ping(self.port):
            if process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"redis-server did not answer PING on port {self.port}:\n{tail}")
            time.sleep(0.05)
        return self

    def flush(self) -> None:
        """Empty every database (FLUSHALL)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            sock.sendall(b"FLUSHALL\r\n")
            answer = sock.recv(64)
        if not answer.startswith(b"+OK"):
            raise RuntimeError(f"redis-server on port {self.port} answered FLUSHALL with {answer!r}")

    def stop(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()
