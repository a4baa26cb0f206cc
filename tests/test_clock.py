from __future__ import annotations

import pytest

from tests.clock import Clock


def test_the_clock_stands_still_until_advanced_and_never_goes_back() -> None:
    clock = Clock(5.0)
    assert clock() == clock() == 5.0
    clock.advance(2.5)
    assert clock() == 7.5
    with pytest.raises(ValueError):
        clock.advance(-1)
    assert Clock()() == 0.0
