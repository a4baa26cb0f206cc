"""``tenantgate serve --workers N``: N gateway processes on one port, under a supervisor that keeps them running.

One listening socket, opened by the supervisor and inherited by every worker, not ``SO_REUSEPORT``: with
``SO_REUSEPORT`` each worker has its own accept queue and the kernel hashes each new connection to one of them, so
the connections waiting in a worker's queue when it dies are reset, and until it is replaced a share of new
connections still hash to its (closed) socket's slot. With one inherited socket there is one accept queue: while a
worker is dead, the others take every connection, nothing queued is lost (the supervisor holds the socket open),
and the replacement just starts accepting. What a client of a killed worker sees: the requests in flight on that
worker (and its other kept-alive connections) are cut (connection reset, or a stream that ends without its last
event); no other request fails. The cost of one queue is that the kernel's wake-ups decide which worker accepts
(not a fair hash), which spreads busy connections unevenly when few clients keep connections alive.

The supervisor: starts the workers, restarts one that exits with a backoff (0.5 s, doubling to 30 s while workers
die within 10 s of starting), forwards SIGHUP (each worker reloads its config), and on SIGTERM or SIGINT closes
its own copy of the socket, forwards the signal (each worker drains as one gateway does: /readyz fails, in-flight
requests finish) and exits 0 when all have. Workers share what must be shared through Redis (``state.redis_url``:
residency, rate limits, the registry, reloads), so more than one worker without it is refused.

Metrics: prometheus-client's multiprocess files, written at intervals and before each scrape rather than at each
increment (gateway/observe/shared_metrics.py). The supervisor gives the workers one private directory; each
worker's counters and histograms are summed across workers at every scrape (those of a worker that died included,
so counters never go back; a worker killed outright loses its last half second), gauges are per worker (a ``pid``
label). Collectors that read live state at scrape time
(the fleet's health, loads and engine figures, ``process_*``) are not shared that way: they are the answering
worker's own. In the same directory the workers find each other: one of them scrapes the engines for all
(gateway/fleet/host_scrape.py), and the worker that answers an admin request merges every worker's figures
(gateway/admin/siblings.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from gateway.config import ConfigError, GatewayConfig
from gateway.observe.shared_metrics import MULTIPROC_ENV

log = logging.getLogger("tenantgate.workers")

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
CRASH_LOOP_S = 10.0  # a worker that dies sooner than this after its start doubles the next restart's delay
IDLE_WAIT_S = 5.0  # the longest the supervisor sleeps with nothing due (it is woken by every signal)
BACKLOG = 1024  # the one accept queue: connections wait here while workers are busy or one is being replaced
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class WorkerSockets:
    """What a worker inherits: its number, how many workers there are, the listening sockets' file descriptors,
    and the supervisor's private directory (mode 0700), where the workers find each other: the engine scrapes
    shared from one worker (gateway/fleet/host_scrape.py) and each worker's own state for the merged admin view
    (gateway/admin/siblings.py)."""

    worker: int
    workers: int
    listen_fd: int
    operator_fd: int | None
    directory: Path

    def encode(self) -> str:
        operator = self.operator_fd if self.operator_fd is not None else "-"
        return f"{self.worker}:{self.workers}:{self.listen_fd}:{operator}:{self.directory}"

    @classmethod
    def decode(cls, text: str) -> WorkerSockets:
        worker, workers, listen_fd, operator_fd, directory = text.split(":", 4)  # the directory may hold a ':'
        operator = None if operator_fd == "-" else int(operator_fd)
        return cls(int(worker), int(workers), int(listen_fd), operator, Path(directory))

    def socket_path(self, what: str, worker: int | None = None) -> Path:
        """Where worker ``worker`` (default: this one) listens for ``what`` from its siblings."""
        return self.directory / f"{what}-{self.worker if worker is None else worker}.sock"

    def siblings(self) -> list[int]:
        return [worker for worker in range(self.workers) if worker != self.worker]

    def listening(self) -> socket.socket:
        return socket.socket(fileno=self.listen_fd)

    def operator_listening(self) -> socket.socket | None:
        return None if self.operator_fd is None else socket.socket(fileno=self.operator_fd)


def follow_supervisor() -> None:
    """In a worker: be sent SIGTERM (and so drain) if the supervisor dies, rather than serve on unsupervised."""
    supervisor = os.getppid()
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != supervisor:  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def check(config: GatewayConfig, workers: int) -> None:
    """Refuse a worker count the config cannot serve (ConfigError)."""
    if workers < 1:
        raise ConfigError("--workers", ["--workers: at least 1"])
    if workers > 1 and config.state.redis_url is None:
        raise ConfigError(
            "--workers",
            [
                f"--workers {workers}: workers share residency, rate limits and the registry through Redis; "
                "set state.redis_url, or run one worker (the default)"
            ],
        )


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    sock.set_inheritable(True)
    return sock


@dataclass
class _Worker:
    number: int
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    failures: int = 0  # deaths in a row, each within CRASH_LOOP_S of its start
    restart_at: float | None = None


class Supervisor:
    def __init__(self, config: GatewayConfig, config_path: Path, workers: int) -> None:
        self.config, self.config_path = config, config_path
        self.workers = [_Worker(number) for number in range(workers)]
        self._signals: list[int] = []

    def run(self) -> int:
        listener = _listen(self.config.listen.host, self.config.listen.port)
        operator = self.config.admin.listen
        operator_sock = _listen(operator.host, operator.port) if operator is not None else None
        # One private directory (mkdtemp: mode 0700): the metrics files, and the workers' sockets to each other.
        runtime = Path(tempfile.mkdtemp(prefix="tenantgate-workers-"))
        metrics_dir = runtime / "metrics"
        metrics_dir.mkdir()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self._wake_on_signals()
        sockets = (listener.fileno(), operator_sock.fileno() if operator_sock is not None else None)
        log.info(
            "supervisor: %d workers on http://%s:%d",
            len(self.workers), self.config.listen.host, listener.getsockname()[1],
        )  # fmt: skip
        try:
            for worker in self.workers:
                self._start(worker, sockets, metrics_dir)
            stopping = self._supervise(sockets, metrics_dir)
            listener.close()  # new connections go nowhere now; the workers drain what they accepted
            if operator_sock is not None:
                operator_sock.close()
            return self._drain(stopping)
        finally:
            for worker in self.workers:
                if worker.process is not None and worker.process.poll() is None:
                    worker.process.kill()
                    worker.process.wait()
            shutil.rmtree(runtime, ignore_errors=True)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)

    def _wake_on_signals(self) -> None:
        """Every signal, a worker's death (SIGCHLD) included, wakes ``_supervise``'s wait: the C-level handler
        writes its number to a pipe, which the wait selects on. The supervisor then sleeps until something happens
        or a restart is due, where it woke every 50 ms to poll (20 wake-ups a second, 1-2 ms of CPU a second, on
        the cores its workers serve from)."""
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        signal.set_wakeup_fd(self._wake_write)
        # SIGCHLD's default action is to ignore it, and an ignored signal writes nothing: a handler that does
        # nothing (the loop polls the workers once woken).
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)

    def _start(self, worker: _Worker, sockets: tuple[int, int | None], metrics_dir: Path) -> None:
        inherited = WorkerSockets(worker.number, len(self.workers), *sockets, metrics_dir.parent)
        cmd = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(self.config_path)]
        cmd += ["--worker-sockets", inherited.encode()]
        fds = [fd for fd in sockets if fd is not None]
        # SIGHUP ignored across the exec (an ignored signal stays ignored; a handler does not), until the worker's
        # server handles it: its default action would end a worker that a reload reaches while it starts (the
        # worker reads the config file as it starts anyway).
        previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
        try:
            worker.process = subprocess.Popen(cmd, pass_fds=fds, env={**os.environ, MULTIPROC_ENV: str(metrics_dir)})
        finally:
            signal.signal(signal.SIGHUP, previous)
        worker.started, worker.restart_at = time.monotonic(), None
        log.info("worker %d started (pid %d)", worker.number, worker.process.pid)

    def _supervise(self, sockets: tuple[int, int | None], metrics_dir: Path) -> int:
        """Keep the workers running until SIGTERM or SIGINT; returns that signal."""
        while True:
            while self._signals:
                signum = self._signals.pop(0)
                if signum == signal.SIGHUP:
                    log.info("supervisor: SIGHUP: every worker reloads its config")
                    self._send(signal.SIGHUP)
                else:
                    return signum
            now = time.monotonic()
            for worker in self.workers:
                process = worker.process
                if process is not None and worker.restart_at is None and process.poll() is not None:
                    self._died(worker, process, now, metrics_dir)
                if worker.restart_at is not None and now >= worker.restart_at:
                    self._start(worker, sockets, metrics_dir)
            if not self._signals:
                self._wait(now)

    def _wait(self, now: float) -> None:
        """Until a signal comes (a worker's death is one: SIGCHLD) or the next restart is due."""
        due = [worker.restart_at for worker in self.workers if worker.restart_at is not None]
        # A bound all the same (a signal that came between the check above and the select has written to the
        # pipe already, so none is missed; the bound only caps the damage of a surprise).
        timeout = min([*due, now + IDLE_WAIT_S]) - now
        select.select([self._wake_read], [], [], max(0.0, timeout))
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_read, 512):  # the signals' numbers: the handlers have recorded them
                pass

    def _died(self, worker: _Worker, process: subprocess.Popen[bytes], now: float, metrics_dir: Path) -> None:
        # A dead worker's gauges go (its counters and histograms stay in the sums): mark_process_dead drops the
        # live modes' files, and the default mode's ('all', one series per pid) are removed here.
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(process.pid, str(metrics_dir))  # type: ignore[no-untyped-call]  # untyped
        for gauges in metrics_dir.glob(f"gauge_*_{process.pid}.db"):
            gauges.unlink(missing_ok=True)
        worker.failures = worker.failures + 1 if now - worker.started < CRASH_LOOP_S else 0
        delay = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, worker.failures - 1))
        worker.restart_at = now + delay
        log.warning(
            "worker %d (pid %d) exited with %s: restarting it in %.1f s",
            worker.number, process.pid, process.returncode, delay,
        )  # fmt: skip

    def _send(self, signum: int) -> None:
        for worker in self.workers:
            if worker.process is not None and worker.process.poll() is None:
                worker.process.send_signal(signum)

    def _drain(self, signum: int) -> int:
        log.info("supervisor: %s: every worker drains", signal.Signals(signum).name)
        self._send(signum)
        shutdown = self.config.shutdown
        deadline = time.monotonic() + shutdown.drain_delay_s + shutdown.drain_timeout_s + 10
        for worker in self.workers:
            if worker.process is None:
                continue
            try:
                worker.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker %d did not stop in time: killed", worker.number)
                worker.process.kill()
                worker.process.wait()
        log.info("supervisor: every worker stopped")
        return 0


def supervise(config: GatewayConfig, config_path: Path, workers: int) -> int:
    check(config, workers)
    return Supervisor(config, config_path, workers).run()
