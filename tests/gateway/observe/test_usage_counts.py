"""The token counts a request's record takes from the engine's answer (``RequestRecord.read_usage``): an engine's
figure, read on the request path, so one that is absurd (more digits than Python converts: a broken or hostile
engine) is left out rather than raising there, which failed the answer with a 500 or cut its stream."""

from __future__ import annotations

import pytest

from gateway.observe.telemetry import RequestRecord


@pytest.mark.parametrize(
    ("usage", "prompt", "completion"),
    [
        pytest.param(b'{"usage":{"prompt_tokens":12,"completion_tokens":3}}', 12, 3, id="plain"),
        pytest.param(b'{"usage":{"prompt_tokens":%s,"completion_tokens":3}}' % (b"9" * 5000), None, 3, id="absurd"),
        pytest.param(b'{"usage":{"prompt_tokens":4,"completion_tokens":%s}}' % (b"1" * 20), 4, None, id="over-15"),
    ],
)
def test_counts_are_taken_when_they_are_numbers_a_counter_holds(
    usage: bytes, prompt: int | None, completion: int | None
) -> None:
    record = RequestRecord("/v1/completions")
    record.read_usage(usage)
    assert (record.prompt_tokens, record.completion_tokens) == (prompt, completion)
