"""The offline bounds on a trace's cold loads: Belady's rule, least recently used, and eviction by popularity."""

from __future__ import annotations

import pytest

from loadtests.cold_load_floor import cold_loads, main

# Two slots, holding a and b at first.
REQUESTS = ["a", "b", "c", "a", "b", "c", "a"]
WEIGHTS = {"a": 3.0, "b": 2.0, "c": 1.0}


@pytest.mark.parametrize(
    ("rule", "paid"),
    [
        ("lru", 5),  # c evicts a, a evicts b, b evicts c, c evicts a, a evicts b: every miss evicts the next one wanted
        ("popularity", 3),  # c pushes out b, b pushes out c, c pushes out b: a, the most wanted, stays
        ("belady", 3),  # c pushes out b (needed after a), b pushes out a (needed after c), then a: the fewest
    ],
)
def test_each_rule_counts_its_cold_loads(rule: str, paid: int) -> None:
    assert cold_loads(REQUESTS, 2, ["a", "b"], rule, WEIGHTS) == paid


def test_belady_is_a_floor_for_the_other_rules_on_the_benchmarks_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--trace", "churn", "--seeds", "17", "--seconds", "10"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    counts = [int(part.rsplit(" ", 1)[1]) for part in line.split("; ", 1)[1].split(", ")]
    assert counts[0] <= counts[1] <= counts[2], line
