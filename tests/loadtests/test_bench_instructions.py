"""The instruction-count benchmark's parts: the dumps' totals are summed, and a setup's count comes from its server
process with instrumentation on only while the measured requests go."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.bench_instructions import ADAPTER, callgrind_available, measure, part_totals, total_instructions
from loadtests.bench_overhead import _preload
from loadtests.fleet import simulated_replicas, write_adapters


def test_the_totals_of_every_dump_are_summed(tmp_path: Path) -> None:
    out = tmp_path / "x.callgrind"
    out.write_text("events: Ir\nsummary: 0\ntotals: 0\n")  # the final dump, written with instrumentation off
    (tmp_path / "x.callgrind.1").write_text("events: Ir\nsummary: 0\nfn=(1)\n0 5\ntotals: 1200\n")
    (tmp_path / "x.callgrind.2").write_text("totals: 34\n")
    (tmp_path / "other.callgrind.1").write_text("totals: 99999\n")
    assert total_instructions(out) == 1234


@pytest.mark.skipif(not callgrind_available(), reason="valgrind (callgrind) is not installed")
def test_a_setup_is_counted_only_while_its_requests_go(tmp_path: Path) -> None:
    """Twice the requests, about the same count per request: what start-up and the warm-up ran is not counted (it
    is far more than the requests themselves)."""
    with simulated_replicas(tmp_path, 1, "--time-scale", "0") as urls:
        adapters = write_adapters(tmp_path, [ADAPTER])
        _preload([urls["r0"]], adapters)
        few, more = (measure("bare-fast", urls["r0"], tmp_path, adapters, n) for n in (20, 40))
    assert 30 < few < 1000 and 30 < more < 1000
    assert 0.5 < few / more < 2


def test_each_dump_is_read_in_the_order_it_was_dumped(tmp_path: Path) -> None:
    out = tmp_path / "x.callgrind"
    out.write_text("totals: 0\n")  # the final dump: not a numbered part
    for number, total in ((1, 500), (2, 70), (10, 3)):
        (tmp_path / f"x.callgrind.{number}").write_text(f"summary: 0\ntotals: {total}\n")
    assert part_totals(out) == [500, 70, 3]
