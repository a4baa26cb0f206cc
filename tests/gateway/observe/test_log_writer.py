"""The log's writer never blocks its caller: lines go through a bounded queue to a thread that formats and writes
them; lines beyond the queue are dropped and counted; a SIGTERM'd gateway writes every queued line before it exits."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.observe import logs
from gateway.observe.metrics import GatewayMetrics
from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config
from loadtests.processes import free_port, healthy
from tests.servers import EngineProcess


@pytest.fixture
def root_logging() -> Iterator[None]:
    """logs.configure replaces the root logger's handlers: give pytest's back after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        logs.shutdown()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


class _Blocked(io.StringIO):
    """A stream whose writes wait until released: a stalled stderr."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def write(self, text: str) -> int:
        self.entered.set()
        assert self.release.wait(timeout=30)
        return super().write(text)


class _Seen(logging.Handler):
    """Another handler on the root: keeps the records it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _wait(condition: threading.Event) -> None:
    assert condition.wait(timeout=10)


def test_a_line_is_formatted_on_the_writer_thread_not_the_callers(root_logging: None) -> None:
    formatted_on: list[int] = []

    class Probe:
        def __str__(self) -> str:  # called when the message's %s is rendered
            formatted_on.append(threading.get_ident())
            return "probe"

    stream = io.StringIO()
    logs.configure(stream=stream, worker=3)
    logging.getLogger("tenantgate.test").info("value %s", Probe())
    logs.shutdown()  # writes what is queued
    [line] = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert line["message"] == "value probe" and line["worker"] == 3
    # QueueHandler's own prepare renders the message on the caller's thread.
    assert formatted_on and threading.get_ident() not in formatted_on


def test_lines_beyond_the_queue_are_dropped_and_counted_never_waited_for(root_logging: None) -> None:
    stream = _Blocked()
    logs.configure(stream=stream, queue_lines=5)
    log = logging.getLogger("tenantgate.test")
    log.info("first")  # the writer takes it and blocks in write: the queue is empty again
    _wait(stream.entered)
    for number in range(8):  # 5 fit in the queue; the caller is never made to wait for the other 3
        log.info("line %d", number)
    assert logs.dropped_lines() == 3
    exposition = GatewayMetrics().exposition().decode()
    assert "tenantgate_log_lines_dropped_total 3.0" in exposition
    stream.release.set()
    logs.shutdown()
    written = [json.loads(text)["message"] for text in stream.getvalue().splitlines()]
    assert written == ["first", *(f"line {n}" for n in range(5))]


def test_lines_queued_together_are_written_with_one_write(root_logging: None) -> None:
    """The writer takes every line queued while it was busy and writes them at once (one write, one flush), not
    one write per line."""
    stream = _Blocked()
    writes: list[str] = []
    record_write = stream.write

    def counting(text: str) -> int:
        writes.append(text)
        return record_write(text)

    stream.write = counting  # type: ignore[method-assign]
    logs.configure(stream=stream)
    log = logging.getLogger("tenantgate.test")
    log.info("first")
    _wait(stream.entered)  # the writer is in its first write: the next lines queue behind it
    for number in range(5):
        log.info("line %d", number)
    stream.release.set()
    logs.shutdown()
    assert [len(text.splitlines()) for text in writes] == [1, 5]


def test_an_access_line_on_its_own_path_is_the_object_a_record_of_its_fields_would_be(root_logging: None) -> None:
    """logs.access_line skips the LogRecord when the writer is the log's only way out: the same JSON object, keys
    in the same order, its fields made on the writer's thread; with another handler on the way (here pytest's
    caplog would be one) it is a record as before, which that handler sees."""
    made_on: list[int] = []
    fields = {"event": "request", "path": "/v1/completions", "reasons": ["home"], "status": 200, "ttft_ms": None}

    def made(line: dict[str, object], status: int) -> None:
        made_on.append(threading.get_ident())
        line.update(fields, status=status)

    stream = io.StringIO()
    logs.configure(stream=stream, worker=2)
    access = logging.getLogger("tenantgate.access")
    logs.access_line(access, "request", made, 200)
    access.info("request", extra=fields)
    other = _Seen()
    logging.getLogger().addHandler(other)
    logs.access_line(access, "request", made, 200)
    logs.shutdown()
    own, as_record, with_other = [json.loads(text) for text in stream.getvalue().splitlines()]
    for line in (own, as_record, with_other):
        assert datetime.fromisoformat(line.pop("time")).tzinfo is not None
    assert list(own.items()) == list(as_record.items()) == list(with_other.items())
    assert list(own)[:4] == ["level", "logger", "message", "worker"] and own["status"] == 200
    # The fields were made twice: on the writer thread for the first line, here for the record.
    assert len(made_on) == 2 and made_on.count(threading.get_ident()) == 1
    assert [record.getMessage() for record in other.records] == ["request"]
    assert other.records[0].__dict__["status"] == 200


def test_lines_of_one_fill_function_each_carry_their_own_values(root_logging: None) -> None:
    """The writer reuses one dict per fill function (a fill sets the same keys every time): every line still has
    its own values, keys in the order of a record of its fields, with two fill functions' lines interleaved; a
    fill that sets a key it had not set before still gets that key, in its place."""

    def fill(line: dict[str, object], number: int, extra: bool) -> None:
        line["number"] = number
        line["ttft_ms"] = None if number % 2 else number / 3
        line["reasons"] = [f"r{number}"]
        if extra:
            line["extra"] = number

    def other(line: dict[str, object], number: int, extra: bool) -> None:
        line["other"] = -number

    stream = io.StringIO()
    logs.configure(stream=stream, worker=1)
    access = logging.getLogger("tenantgate.access")
    calls = [(fill if number % 3 else other, number, number == 7) for number in range(8)]
    for function, number, extra in calls:
        logs.access_line(access, "request", function, number, extra)
    logs.shutdown()
    lines = [json.loads(text) for text in stream.getvalue().splitlines()]
    for line, (function, number, extra) in zip(lines, calls, strict=True):
        datetime.fromisoformat(line.pop("time"))
        expected: dict[str, object] = {"level": "INFO", "logger": "tenantgate.access", "message": "request"}
        expected["worker"] = 1
        function(expected, number, extra)
        assert list(line.items()) == list(expected.items())


def test_fill_functions_made_per_line_keep_the_writers_dicts_bounded(root_logging: None) -> None:
    """A caller that makes a fill function per line (a closure) gets every line right, and the writer keeps at most
    ``MAX_FILLS`` dicts rather than one per line."""
    stream = io.StringIO()
    logs.configure(stream=stream)
    writer = logs._writer
    assert writer is not None
    access = logging.getLogger("tenantgate.access")
    count = 3 * logs.MAX_FILLS
    for number in range(count):

        def fill(line: dict[str, object], value: int = number) -> None:
            line["number"] = value

        logs.access_line(access, "request", fill)
    logs.shutdown()
    numbers = [json.loads(text)["number"] for text in stream.getvalue().splitlines()]
    assert numbers == list(range(count))
    assert 0 < len(writer.listener._lines) <= logs.MAX_FILLS


def test_a_line_logged_after_shutdown_is_written_by_its_caller(root_logging: None) -> None:
    stream = io.StringIO()
    logs.configure(stream=stream)
    logs.shutdown()
    logging.getLogger("tenantgate.test").warning("late")
    assert json.loads(stream.getvalue())["message"] == "late"


def _read_slowly(process: subprocess.Popen[bytes]) -> bytes:
    """The process's stderr to its end, a little at a time: the gateway finishes its shutdown while most of its
    lines still wait in the queue, so only the flush on the way out writes them."""
    assert process.stderr is not None
    chunks = []
    deadline = time.monotonic() + 60
    while chunk := os.read(process.stderr.fileno(), 4096):
        chunks.append(chunk)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    process.wait(timeout=30)
    return b"".join(chunks)


def test_sigterm_writes_every_queued_access_line(sim_engine: EngineProcess, tmp_path: Path) -> None:
    """The gateway's stderr is a pipe nobody reads while the requests are sent: it fills (64 KiB) and the writer
    thread blocks on it, the rest of the lines wait in the queue (the requests do not: before the writer thread,
    they hung on the full pipe). SIGTERM, then the pipe is read slowly: every access line is there."""
    requests = 400  # about 450 bytes a line: three times the pipe's buffer
    port = free_port()
    config = gateway_config({"r0": sim_engine.url}, {"acme": ["a1"]}, {"a1": sim_engine.adapters["a1"]}, port=port)
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        env={**os.environ, "TENANTGATE_ADMIN_TOKEN": ADMIN_TOKEN},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not healthy(url, "/readyz"):
            assert process.poll() is None and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.1)
        body = {"model": "a1", "prompt": "x", "max_tokens": 1}
        auth = {"Authorization": f"Bearer {api_key('acme')}"}
        with httpx.Client(base_url=url, headers=auth, timeout=30) as client:
            for _ in range(requests):
                assert client.post("/v1/completions", json=body).status_code == 200
        os.kill(process.pid, signal.SIGTERM)
        stderr = _read_slowly(process)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, stderr.decode(errors="replace")[-2000:]
    objects = [json.loads(line) for line in stderr.decode().splitlines()]
    access = [o for o in objects if o["logger"] == "tenantgate.access"]
    assert len(access) == requests
    assert objects[-1]["message"] == "shut down"
