"""The soak, short: each fault fires once early in the run, and nothing happens that a fault does not explain (no
request lost, no 5xx but a hang's 504, no error outside a fault). The plan and the judgement are also checked alone."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from loadtests.soak import FIRST_FAULT_AT_S, REQUEST_TIMEOUT_S, Window, plan, report, run, unexplained

pytestmark = pytest.mark.timeout(180)

HANG = Window("replica hangs", 10.0, 12.0, frozenset({"error_event", "http_504"}))
ERRORS_503 = Window("replica answers 503", 20.0, 22.0, frozenset())


def test_a_short_soak_fires_every_fault_and_nothing_unexplained_happens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run(minutes=0.4, fault_every_s=5, root=tmp_path, hold_s=2.0)
    assert report(result) == 0, capsys.readouterr().out
    names = [w.name for w in result.windows]
    assert names == ["replica killed", "replica hangs", "replica answers 503", "streams cut after 3 chunks"]
    assert result.windows[-1].started - result.windows[0].started < 20  # all early in the 24 s run
    cut = result.during(result.windows[-1])
    assert cut["error_event"] >= 1, cut  # the stream-cut fault fired, and the gateway said so in the stream
    assert result.outcomes.counts["ok"] > 100
    out = capsys.readouterr().out
    assert "lost: 0 (must be 0)" in out and "5xx: " in out and "errors no fault explains: 0" in out


def test_the_plan_fires_each_fault_once_early_then_in_turns() -> None:
    assert plan(4, 24, 5, 2.0) == [2.0, 7.0, 12.0, 17.0]  # the CI soak: one round, nothing after
    ten_minutes = plan(4, 600, 15, 5)
    assert ten_minutes[:4] == [FIRST_FAULT_AT_S + i * (5 + REQUEST_TIMEOUT_S) for i in range(4)]
    assert all(b - a == 20 for a, b in itertools.pairwise(ten_minutes[4:]))
    assert ten_minutes[-1] + 5 + REQUEST_TIMEOUT_S <= 600
    with pytest.raises(ValueError, match="cannot fire each fault once"):
        plan(4, 20, 5, 2.0)


@pytest.mark.parametrize(
    ("at", "outcome", "explained"),
    [
        (11.0, "http_504", True),  # a hang's deadline
        (14.9, "error_event", True),  # a stream caught in the hang, within the request timeout after its end
        (15.1, "http_504", False),  # too long after the hang
        (5.0, "error_event", False),  # no fault in progress
        (11.0, "http_502", False),  # not a hang's answer
        (21.0, "http_503", False),  # an engine's 503 must be retried, never reach the client
        (11.0, "lost", False),
        (21.0, "ok", True),
    ],
)
def test_only_what_a_fault_in_progress_explains_is_allowed(at: float, outcome: str, explained: bool) -> None:
    assert (sum(unexplained([(at, "t", outcome)], [HANG, ERRORS_503]).values()) == 0) == explained


def test_a_soak_where_every_request_is_a_5xx_fails() -> None:
    timeline = [(float(t), "t", "http_502") for t in range(30)]
    assert sum(unexplained(timeline, [HANG, ERRORS_503]).values()) == 30
