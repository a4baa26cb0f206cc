"""The gateway's log format: every line is one JSON object, so a log pipeline parses each line alone; and the
log's writer, which never blocks the event loop.

Fields: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, ``worker`` under ``serve --workers`` (the
worker's number), then whatever the record carries as structured fields (the access log's request fields, passed
as ``extra``), and ``exc_info`` (the traceback, as one string) when there is one. python-json-logger does the
encoding; Python warnings are routed through logging too.

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
import logging
import queue
import sys
import threading
from logging.handlers import QueueHandler, QueueListener
from typing import IO, Any

from pythonjsonlogger.json import JsonFormatter

_RENAMED = {"levelname": "level", "name": "logger"}

# Lines held while the writer is behind: at the access log's ~400 bytes a line, about 4 MB, and several seconds of
# a busy gateway's lines, enough to ride out a log collector's pause without dropping any.
QUEUE_LINES = 10_000


def json_formatter(static_fields: dict[str, Any] | None = None) -> logging.Formatter:
    return JsonFormatter(
        "{levelname}{name}{message}", style="{", rename_fields=_RENAMED, timestamp="time", static_fields=static_fields
    )


class _Enqueue(QueueHandler):
    """Puts the record on the writer's queue as it is (no formatting here), or counts it as dropped when full."""

    def __init__(self, lines: queue.Queue[logging.LogRecord], output: logging.Handler) -> None:
        super().__init__(lines)
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
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1  # under the handler's lock (Handler.handle holds it around emit)


class _Listener(QueueListener):
    def enqueue_sentinel(self) -> None:
        # QueueListener's put_nowait would raise on a full queue; the thread is draining it, so wait for room.
        self.queue.put(self._sentinel)  # type: ignore[attr-defined]  # QueueListener's own, untyped in typeshed


class _Writer:
    """The queue, its writer thread and the handler that feeds it: one per configured process."""

    def __init__(self, stream: IO[str], static_fields: dict[str, Any] | None, queue_lines: int) -> None:
        output = logging.StreamHandler(stream)
        output.setFormatter(json_formatter(static_fields))
        lines: queue.Queue[logging.LogRecord] = queue.Queue(queue_lines)
        self.handler = _Enqueue(lines, output)
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
