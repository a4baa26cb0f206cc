"""The tests' one manual clock: the code under test reads the time by calling it; the test moves it forward."""

from __future__ import annotations


class Clock:
    """A ``Callable[[], float]`` that stands still until ``advance``; it never goes back."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock only moves forward, not by {seconds} s")
        self._now += seconds
