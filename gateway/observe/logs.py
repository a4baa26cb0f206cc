"""The gateway's log format: every line is one JSON object, so a log pipeline parses each line alone.

Fields: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, then whatever the record carries as
structured fields (the access log's request fields, passed as ``extra``), and ``exc_info`` (the traceback, as one
string) when there is one. python-json-logger does the encoding; Python warnings are routed through logging too.
"""

from __future__ import annotations

import logging

from pythonjsonlogger.json import JsonFormatter

_RENAMED = {"levelname": "level", "name": "logger"}


def json_formatter() -> logging.Formatter:
    return JsonFormatter("{levelname}{name}{message}", style="{", rename_fields=_RENAMED, timestamp="time")


def configure(level: int = logging.INFO) -> None:
    """Every record of every logger, to stderr, one JSON object per line (replaces any handler already there)."""
    handler = logging.StreamHandler()
    handler.setFormatter(json_formatter())
    root = logging.getLogger()
    for previous in list(root.handlers):
        root.removeHandler(previous)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
