"""The simulator's tokenizer: deterministic, dependency-free, and cheap.

A token is a run of at most four non-space characters, taken left to right: ``"hello world"`` is ``hell``,
``o``, ``worl``, ``d``. Counts are stable for a given text, which is all the behaviour model needs (prefill
cost, prefix-cache blocks, ``usage``). The generated words are at most four characters long, so an answer of
N words is exactly N tokens.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(r"\S{1,4}")


def tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text)
