"""The soak, short: steady traffic with a fault every few seconds loses nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.soak import soak

pytestmark = pytest.mark.timeout(180)


def test_a_short_soak_loses_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert soak(minutes=0.4, fault_every_s=5, root=tmp_path) == 0
    report = capsys.readouterr().out
    assert "lost: 0 (must be 0)" in report and "fault: replica killed" in report
