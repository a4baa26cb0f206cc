"""The relay's view of an engine's stream: whole events, however the bytes were split, and the usage event left
out only when the gateway asked for it on the client's behalf."""

from __future__ import annotations

import pytest

from gateway.serving.sse_events import StreamEvents
from tests.metered import MeteredBuffer

TOKEN = b'data: {"id":"c","choices":[{"index":0,"text":"hi"}],"usage":null}\n\n'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12}}\n\n'
DONE = b"data: [DONE]\n\n"
STREAM = TOKEN * 3 + USAGE + DONE


def run(events: StreamEvents, stream: bytes, cut: int) -> tuple[bytes, bytes]:
    complete, onward = b"", b""
    for start in range(0, len(stream), cut):
        seen, sent = events.feed(stream[start : start + cut])
        complete, onward = complete + seen, onward + sent
    rest = events.rest()
    return complete + rest, onward + rest


@pytest.mark.parametrize("cut", [1, 7, 64, len(STREAM)])
def test_the_usage_event_is_left_out_however_the_bytes_come(cut: int) -> None:
    complete, onward = run(StreamEvents(strip_usage=True), STREAM, cut)
    assert complete == STREAM  # what telemetry reads: every event, the usage one whole
    assert onward == TOKEN * 3 + DONE


@pytest.mark.parametrize("cut", [1, 7, len(STREAM)])
def test_a_client_that_asked_for_usage_gets_every_byte(cut: int) -> None:
    assert run(StreamEvents(strip_usage=False), STREAM, cut) == (STREAM, STREAM)


def test_an_event_goes_on_as_soon_as_it_is_whole() -> None:
    events = StreamEvents(strip_usage=True)
    assert events.feed(TOKEN[:10]) == (b"", b"")
    assert events.feed(TOKEN[10:] + USAGE[:5]) == (TOKEN, TOKEN)
    assert events.feed(USAGE[5:]) == (USAGE, b"")


def test_only_the_usage_event_is_taken_out() -> None:
    lookalike = b'data: {"choices":[{"text":"\\"prompt_tokens\\""}],"usage":{"prompt_tokens":1}}\n\n'
    events = StreamEvents(strip_usage=True)
    assert events.feed(lookalike + b": comment prompt_tokens\n\n") == (lookalike + b": comment prompt_tokens\n\n",) * 2


def test_bytes_that_never_end_an_event_are_not_held_forever() -> None:
    events = StreamEvents(strip_usage=True)
    blob = b"x" * (1 << 20)
    assert events.feed(blob) == (b"", b"")
    assert events.feed(b"y") == (blob + b"y", blob + b"y")


@pytest.mark.timeout(30)  # a hang guard, not a speed bound: the loop this guards against never ended
@pytest.mark.parametrize("blank", [b"\n", b"\n\n", b"\n\n\n"], ids=["one", "two", "three"])
def test_blank_lines_after_an_event_pass_on_as_they_are(blank: bytes) -> None:
    """SSE lets blank lines follow an event (clients skip them); an engine that sends some after its usage event
    sent the splitting of a stream into events round forever (the event loop, and so the gateway, hung)."""
    events = StreamEvents(strip_usage=True)
    assert events.feed(TOKEN + USAGE + blank) == (TOKEN + USAGE + blank, TOKEN + blank)
    assert events.feed(DONE) == (DONE, DONE)


def test_an_event_sent_in_small_pieces_costs_its_length_not_its_square() -> None:
    """A broken or hostile engine that sends an event a few bytes at a time (a 1 MiB event in 16-byte pieces): the
    held bytes are appended to in place and only the new ones searched for the event's end. Joined anew and searched
    again for each piece, 1 MiB in 10-byte pieces cost the event loop, every tenant's requests, 85 s of CPU. Counted,
    not timed (tests/metered.py): the bytes the held buffer's operations walk over stay within a few times the
    event's length; the old join walked about 65,000 times it."""
    event = b"data: " + b"x" * ((1 << 20) - 100) + b"\n\n"
    events = StreamEvents(strip_usage=True)
    held = events._pending = MeteredBuffer()
    seen = [events.feed(event[start : start + 16]) for start in range(0, len(event), 16)]
    assert [complete for complete, _ in seen if complete] == [event]
    assert events._pending is held  # appended to in place, never replaced by a joined copy
    assert held.touched <= 8 * len(event), held.touched / len(event)
