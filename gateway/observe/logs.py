"""The gateway's log format: every line is one JSON object, so a log pipeline parses each line alone; and the
log's writer, which never blocks the event loop.

Fields: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, ``worker`` under ``serve --workers`` (the
worker's number), then whatever the record carries as structured fields (the access log's request fields, passed
as ``extra``), and ``exc_info`` (the traceback, as one string) when there is one. python-json-logger does the
encoding (with orjson); Python warnings are routed through logging too.

The access line's own path (``access_line``): when the log goes only to this writer (the default), the access log
puts a tuple on the queue (its logger, message, time, and the function and arguments that fill in its fields), with
no ``LogRecord`` and no trip through logging's handlers, and the writer encodes it with orjson into the same JSON
object the formatter writes (the line's time is when it was queued, as a record's). About 15 us of the event loop's
time per request went to making the record and handing it through logging (make bench-overhead); a logging set-up
that adds a handler or a filter anywhere on the way gets records as before. On the writer, each fill function has
one dict of its own, reused line after line: the fill sets the same keys every time, so the dict keeps its keys'
order and size and each line only replaces the values (no dict made, grown, merged and freed per line).

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
from collections.abc import Callable
from datetime import UTC, datetime
from logging.handlers import QueueHandler, QueueListener
from typing import IO, Any

import orjson
from pythonjsonlogger.orjson import OrjsonFormatter

_RENAMED = {"levelname": "level", "name": "logger"}

# Lines held while the writer is behind: at the access log's ~400 bytes a line, about 4 MB, and several seconds of
# a busy gateway's lines, enough to ride out a log collector's pause without dropping any.
QUEUE_LINES = 10_000
# How long the writer thread waits between batches: the most a line waits beyond its turn in the queue. 50 ms, not
# 5: each wake-up takes the GIL from the event loop and back (make bench-overhead's realistic load: about 9 us of
# CPU per request less), and at ~2,000 lines a second a batch of ~100 lines stays far below QUEUE_LINES.
BATCH_S = 0.05
# Fill functions whose dict the writer keeps (one per function: the access log has one): a bound, not a size to tune.
MAX_FILLS = 64


def json_formatter(static_fields: dict[str, Any] | None = None) -> logging.Formatter:
    # orjson encodes (as the request bodies are: gateway/serving/json_body.py), not the standard library's json
    # encoder, which showed in the writer thread's share of make bench-overhead's profile.
    return OrjsonFormatter(
        "{levelname}{name}{message}", style="{", rename_fields=_RENAMED, timestamp="time", static_fields=static_fields
    )


# The function that fills in an access line's fields on the writer's thread: ``fill(fields, *args)``.
Fill = Callable[..., None]
# A line queued by ``access_line``: its logger's name, message, when it was logged (time.time()), its fill function
# and that function's arguments. A plain tuple, not an object: an instance with an ``__init__`` and the
# ``functools.partial`` it replaced cost the event loop about 3.5 k instructions a line (callgrind).
Line = tuple[str, str, float, Fill, tuple[Any, ...]]

# A line's time as a naive UTC datetime, which orjson writes with ``+00:00`` (OPT_NAIVE_UTC): the same text as
# ``datetime.fromtimestamp(created, tz=UTC)`` in 2.4 k instructions with its encoding against 5.9 k (callgrind).
# Python 3.12 deprecates utcfromtimestamp: there the aware datetime, as before.
if sys.version_info >= (3, 12):

    def _utc(created: float) -> datetime:
        return datetime.fromtimestamp(created, UTC)

else:
    _utc = datetime.utcfromtimestamp  # naive UTC on purpose (above)

_LINE_OPTIONS = orjson.OPT_NAIVE_UTC


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

    def enqueue(self, record: logging.LogRecord | Line) -> None:  # a Line too
        if self.stopped:
            self.output.handle(record if isinstance(record, logging.LogRecord) else _as_record(record))
            return
        # A SimpleQueue (C, no condition variable to notify: a put costs the caller a fraction of Queue's), bounded
        # here: qsize is exact enough for a bound that only the writer's falling far behind reaches.
        if self.queue.qsize() >= self.bound:  # type: ignore[attr-defined]
            self.dropped += 1  # under the handler's lock (Handler.handle holds it around emit)
        else:
            self.queue.put_nowait(record)

    def handle_line(self, line: Line) -> None:
        """``access_line``'s way in: queued as a record would be, under the handler's lock as ``handle`` takes it."""
        # acquire and release, not ``with``: a with statement looks up __enter__ and __exit__ and makes a bound
        # method of each, about 2 k instructions a line on the event loop (callgrind).
        lock = self.lock
        lock.acquire()  # type: ignore[union-attr]  # a handler's lock exists once it is made
        try:
            self.enqueue(line)
        finally:
            lock.release()  # type: ignore[union-attr]


class _Listener(QueueListener):
    """The writer thread: it takes every line queued, writes them with one write and one flush, then waits
    ``BATCH_S`` before it looks again. Woken per line (as QueueListener is), the thread's wake-ups and the GIL
    handed to it and back, and a write and a flush per line, cost the event loop more than the lines themselves
    (make bench-overhead); in batches a line waits at most ``BATCH_S`` longer, and a queued line costs its caller
    a put that wakes nobody."""

    def __init__(
        self,
        lines: queue.SimpleQueue[logging.LogRecord | Line],
        output: logging.StreamHandler[IO[str]],
        static_fields: dict[str, Any] | None,
    ) -> None:
        super().__init__(lines, output)
        self.lines, self.output, self.static = lines, output, static_fields or {}
        # Each fill function's line, reused (the module docstring says why): the dict and its size once filled.
        self._lines: dict[Fill, tuple[dict[str, Any], int]] = {}

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

    def _write(self, records: list[logging.LogRecord | Line]) -> None:
        output, texts = self.output, []
        for record in records:
            try:
                texts.append(self._encode(record) if isinstance(record, tuple) else output.format(record))
            except Exception:
                output.handleError(record if isinstance(record, logging.LogRecord) else _as_record(record))
        if not texts:
            return
        with output.lock:  # type: ignore[union-attr]  # a handler's lock exists once it is made
            try:
                output.stream.write("\n".join(texts) + "\n")
                output.flush()
            except Exception:
                output.handleError(logging.makeLogRecord({"msg": "writing log lines failed"}))

    def _encode(self, line: Line) -> str:
        """The object json_formatter writes for a record of the line's fields, in its order: level, logger,
        message, the static fields, the line's own, time."""
        name, message, created, fill, args = line
        reused = self._lines.get(fill)
        if reused is not None:
            text, size = reused
            text["logger"], text["message"] = name, message
            fill(text, *args)  # the same keys as every time before: only the values change
            if len(text) == size:
                text["time"] = _utc(created)
                return orjson.dumps(text, option=_LINE_OPTIONS).decode()
            # The fill set a key it had not before: this line, and the ones after, in a dict made afresh.
        text = {"level": "INFO", "logger": name, "message": message, **self.static}
        fill(text, *args)
        text["time"] = _utc(created)
        encoded = orjson.dumps(text, option=_LINE_OPTIONS).decode()
        if len(self._lines) >= MAX_FILLS and fill not in self._lines:
            # A caller making a fill function per line (a lambda, a closure) would grow this without end: start
            # over (each kept fill's next line makes its dict afresh, as its first did).
            self._lines.clear()
        self._lines[fill] = (text, len(text))  # only once it was filled and encoded without an error
        return encoded


def _as_record(line: Line) -> logging.LogRecord:
    """The line as the LogRecord the logger would have made (when the writer has stopped, or fails)."""
    name, message, created, fill, args = line
    record = logging.getLogger(name).makeRecord(name, logging.INFO, "", 0, message, (), None)
    record.__dict__.update(_fields(fill, args))
    record.created = created
    return record


def _fields(fill: Fill, args: tuple[Any, ...]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    fill(fields, *args)
    return fields


class _Writer:
    """The queue, its writer thread and the handler that feeds it: one per configured process."""

    def __init__(self, stream: IO[str], static_fields: dict[str, Any] | None, queue_lines: int) -> None:
        output = logging.StreamHandler(stream)
        output.setFormatter(json_formatter(static_fields))
        lines: queue.SimpleQueue[logging.LogRecord | Line] = queue.SimpleQueue()
        self.handler = _Enqueue(lines, output, queue_lines)  # type: ignore[arg-type]  # Lines too
        self.listener = _Listener(lines, output, static_fields)
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


def access_line(logger: logging.Logger, message: str, fill: Fill, *args: Any) -> None:
    """Log an INFO line on ``logger`` whose fields ``fill(fields, *args)`` sets in the dict ``fields``, on the
    writer's thread: straight onto the writer's queue when nothing else would see the record (the module docstring
    says why), else as a record through logging. ``fill`` must set the same keys, in the same order, on every call
    (the writer reuses one dict per fill function: a key it left out would keep the previous line's value), and be
    one function for the process's life, not one made per line (the writer keeps at most ``MAX_FILLS`` such dicts:
    more start it over, each line still right but made afresh)."""
    writer = _writer
    if writer is not None and _only_to(logger, writer.handler):
        writer.handler.handle_line((logger.name, message, time.time(), fill, args))
        return
    record = logger.makeRecord(logger.name, logging.INFO, "", 0, message, (), None, extra=_fields(fill, args))
    logger.handle(record)


def _only_to(logger: logging.Logger, handler: _Enqueue) -> bool:
    """Whether a record of ``logger``'s would reach ``handler`` alone, unfiltered: no filter on the logger, no
    handler on the way to the root, and the root's one handler is ``handler`` (no filter, level INFO or below)."""
    if logger.filters or logger.disabled or handler.filters or handler.level > logging.INFO or handler.stopped:
        return False
    current: logging.Logger | None = logger
    while current is not None and current.parent is not None:  # up to the root
        if current.handlers or not current.propagate:
            return False
        current = current.parent
    root = logging.getLogger()
    return len(root.handlers) == 1 and root.handlers[0] is handler


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
