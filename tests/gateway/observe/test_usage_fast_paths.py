"""The access line's cheaper paths give what the plain ones gave: ``_first`` is ``pattern.search`` (the same match,
found from where a byte search saw the field's name), and ``_ms`` is ``round(1000 * seconds, 3)`` to within one
rounding step (c4fc1c5 says so; these pin it); the writer's time for a line is the text the aware datetime gave."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.observe import logs
from gateway.observe.telemetry import _COMPLETION_TOKENS, _PROMPT_TOKENS, _first, _ms

# Pieces an answer's bytes are made of: the fields' names with and without a number after them, digits, spaces,
# JSON punctuation, so that near misses (a name with no number, a number too long) come before the real field.
PIECES = st.sampled_from(
    [b'"prompt_tokens"', b'"completion_tokens"', b":", b" ", b"\n", b"12", b"7", b"0" * 16, b",", b"{", b"}", b'"x"']
)


@given(st.lists(PIECES, max_size=24))
@example(
    [
        b'"prompt_tokens"',
        b",",
        b'"completion_tokens"',
        b",",
        b'"prompt_tokens"',
        b":",
        b"7",
        b'"completion_tokens"',
        b":",
        b"12",
    ]
)
def test_first_is_the_patterns_search(parts: list[bytes]) -> None:
    data = b"".join(parts)
    for pattern, name in ((_PROMPT_TOKENS, b'"prompt_tokens"'), (_COMPLETION_TOKENS, b'"completion_tokens"')):
        fast, plain = _first(pattern, data, data.find(name)), pattern.search(data)
        assert (fast and (fast.span(), fast.group(1))) == (plain and (plain.span(), plain.group(1)))


@given(st.floats(min_value=0, max_value=86_400, allow_nan=False))
def test_ms_is_rounding_to_the_microsecond(seconds: float) -> None:
    assert abs(_ms(seconds) - round(1000 * seconds, 3)) <= 0.001 + 1e-9


@given(st.floats(min_value=0, max_value=4_102_444_800, allow_nan=False))  # to 2100
@example(1_700_000_000.0)  # no microseconds: the text has none either
@example(1_700_000_000.0000005)  # a halfway microsecond
def test_a_lines_time_is_the_aware_datetimes_text(created: float) -> None:
    """The writer's naive UTC datetime, written with OPT_NAIVE_UTC, is the text of the aware one it replaced."""
    cheap = orjson.dumps(logs._utc(created), option=logs._LINE_OPTIONS)
    assert cheap == orjson.dumps(datetime.fromtimestamp(created, tz=UTC))
