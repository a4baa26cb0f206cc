"""The README's figures for what balanced homes cost at a change, re-measured on fewer draws (loadtests/ring_churn.py
prints them on 200): a replica joining moves 4-10% of the keys between the others on average, besides its own
share; one key more moves at most 2.5 others on average, except when it raises the per-replica cap, when it moves
about a quarter to all of the replica count."""

from __future__ import annotations

import statistics

import pytest

from loadtests.ring_churn import FLEETS, measure


@pytest.mark.parametrize("replicas", FLEETS)
def test_the_churn_the_readme_states(replicas: int) -> None:
    churn = measure(replicas, draws=40)
    assert 0.04 <= statistics.mean(churn.join_elsewhere) <= 0.10
    assert statistics.mean(churn.join_to_new) == pytest.approx(1 / (replicas + 1), rel=0.35)
    assert statistics.mean(churn.added_under) <= 2.5
    assert 0.15 * replicas <= statistics.mean(churn.added_crossing) <= 1.1 * replicas
