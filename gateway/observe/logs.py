"""The gateway's log format: every line is one JSON object, so a log pipeline parses each line alone; and the
log's writer, which never blocks the event loop.

Fields: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, ``worker`` under ``serve --workers`` (the
worker's number), then whatever the record carries as structured fields (the access log's request fields, passed
as ``extra``), and ``exc_info`` (the traceback, as one string) when there is one. python-json-logger does the
encoding (with orjson); Python warnings are routed through logging too.

The writer: a caller (the event loop, for the access log) only puts the record on a bounded queue; a thread
formats it and writes it. ``QueueHandler`` would format on the caller's thread (its ``prepare`` renders the message
and the traceback), so ``_Enqueue.prepare`` leaves the record as it is: the JSON encoding, the message's ``%``
arguments and any traceback are rendered on the writer thread. When the writer falls behind (a stalled stderr) by
more than ``QUEUE_LINES`` lines, new lines are dropped and counted (``dropped_lines``, exported as
``tenantgate_log_lines_dropped_total``) rather than making the caller wait. ``shutdown`` writes every queued line
before it returns (the server calls it on its way out, and it runs at exit too), so a SIGTERM loses none.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import queue
import sys
import threading
import time
from logging.handlers import QueueHandler, QueueListener
from typing import IO, Any

from pythonjsonlogger.orjson import OrjsonFormatter

_RENAMED = {"levelname": "level", "name": "logger"}

# Lines held while the writer is behind: at the access log's ~400 bytes a line, about 4 MB, and several seconds of
# a busy gateway's lines, enough to ride out a log collector's pause without dropping any.
QUEUE_LINES = 10_000
# How long the writer thread waits between batches: the most a line waits beyond its turn in the queue.
BATCH_S = 0.005


def json_formatter(static_fields: dict[str, Any] | None = None) -> logging.Formatter:
    # orjson encodes (as the request bodies are: gateway/serving/json_body.py), not the standard library's json
    # encoder, which showed in the writer thread's share of make bench-overhead's profile.
    return OrjsonFormatter(
        "{levelname}{name}{message}", style="{", rename_fields=_RENAMED, timestamp="time", static_fields=static_fields
    )


class _Enqueue(QueueHandler):
    """Puts the record on the writer's queue as it is (no formatting here), or counts it as dropped when full."""

    def __init__(self, lines: queue.SimpleQueue[logging.LogRecord], output: logging.Handler, bound: int) -> None:
        super().__init__(lines)
        self.bound = bound
        self.dropped = 0
        self.output = output
        self.stopped = False  # the writer has stopped: lines logged at exit are written here, at once

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # QueueHandler.prepare formats the message (and the traceback) here, on the caller's thread; the writer's
        # formatter does it all. A record's arguments are read a moment later: log values, not objects that change.
        return record

    def enqueue(self, record: logging.LogRecord) -> None:
        if self.stopped:
            self.output.handle(record)
            return
        # A SimpleQueue (C, no condition variable to notify: a put costs the caller a fraction of Queue's), bounded
        # here: qsize is exact enough for a bound that only the writer's falling far behind reaches.
        if self.queue.qsize() >= self.bound:  # type: ignore[attr-defined]
            self.dropped += 1  # under the handler's lock (Handler.handle holds it around emit)
        else:
            self.queue.put_nowait(record)


class _Listener(QueueListener):
    """The writer thread: it takes every line queued, writes them with one write and one flush, then waits
    ``BATCH_S`` before it looks again. Woken per line (as QueueListener is), the thread's wake-ups and the GIL
    handed to it and back, and a write and a flush per line, cost the event loop more than the lines themselves
    (make bench-overhead); in batches a line waits at most ``BATCH_S`` longer, and a queued line costs its caller
    a put that wakes nobody."""

    def __init__(self, lines: queue.SimpleQueue[logging.LogRecord], output: logging.StreamHandler[IO[str]]) -> None:
        super().__init__(lines, output)
        self.lines, self.output = lines, output

    def enqueue_sentinel(self) -> None:
        # Behind every queued line, whatever the bound: the thread writes them all before it stops.
        self.queue.put(self._sentinel)  # type: ignore[attr-defined]  # QueueListener's own, untyped in typeshed

    def _monitor(self) -> None:
        lines, sentinel = self.lines, self._sentinel  # type: ignore[attr-defined]  # untyped in typeshed
        while True:
            batch = [lines.get()]  # blocks only while nothing is queued
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(lines.get_nowait())
            stop = any(record is sentinel for record in batch)
            self._write([record for record in batch if record is not sentinel])
            if stop:
                return
            time.sleep(BATCH_S)

    def _write(self, records: list[logging.LogRecord]) -> None:
        output, texts = self.output, []
        for record in records:
            try:
                texts.append(output.format(record))
            except Exception:
                output.handleError(record)
        if not texts:
            return
        with output.lock:  # type: ignore[union-attr]  # a handler's lock exists once it is made
            try:
                output.stream.write("\n".join(texts) + "\n")
                output.flush()
            except Exception:
                output.handleError(records[0])


class _Writer:
    """The queue, its writer thread and the handler that feeds it: one per configured process."""

    def __init__(self, stream: IO[str], static_fields: dict[str, Any] | None, queue_lines: int) -> None:
        output = logging.StreamHandler(stream)
        output.setFormatter(json_formatter(static_fields))
        lines: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        self.handler = _Enqueue(lines, output, queue_lines)
        self.listener = _Listener(lines, output)
        self.listener.start()
        self._stopped = threading.Lock()

    def stop(self) -> None:
        """Write what is queued, then end the thread (once: later calls return at once)."""
        if self._stopped.acquire(blocking=False):
            # From now on callers write their own lines (the output handler's lock keeps each line whole), so a
            # line logged while the thread drains is not left behind in the queue.
            self.handler.stopped = True
            self.listener.stop()  # puts a sentinel behind the queued lines and joins the thread


_writer: _Writer | None = None  # the process's one log writer: logging itself is per process


def configure(
    level: int = logging.INFO,
    *,
    stream: IO[str] | None = None,
    worker: int | None = None,
    queue_lines: int = QUEUE_LINES,
) -> None:
    """Every record of every logger, through the writer thread to ``stream`` (stderr), one JSON object per line;
    replaces any handler already there (and stops a previous writer after it has written its lines)."""
    global _writer
    static = {"worker": worker} if worker is not None else None
    writer = _Writer(stream if stream is not None else sys.stderr, static, queue_lines)
    root = logging.getLogger()
    for previous in list(root.handlers):
        root.removeHandler(previous)
    root.addHandler(writer.handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    # What a LogRecord looks up when it is made (thread and process names, pid) and no line of ours prints: making
    # each record (on the event loop, for the access log) costs less without them.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    if _writer is not None:
        _writer.stop()
    _writer = writer


def dropped_lines() -> int:
    """Lines dropped since the process started because the writer was ``QUEUE_LINES`` behind."""
    return _writer.handler.dropped if _writer is not None else 0


def queued_lines() -> int:
    """Lines waiting for the writer thread now."""
    return _writer.handler.queue.qsize() if _writer is not None else 0  # type: ignore[attr-defined]


def shutdown() -> None:
    """Write every queued line and stop the writer; lines logged after this are written by their caller."""
    if _writer is not None:
        _writer.stop()


atexit.register(shutdown)  # registered after logging's own: runs first, so its flush sees every line written
