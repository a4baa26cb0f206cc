"""loadtests/bench_json_containers.py runs and prints the table docs/benchmarks.md quotes."""

from __future__ import annotations

import sys

import pytest

from loadtests import bench_json_containers


def test_the_benchmark_prints_its_table(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_json_containers", "--rounds", "1"])
    bench_json_containers.main()
    out = capsys.readouterr().out
    assert "| refused by its bytes (the gateway now) |" in out and "| parsed by orjson (no limit) |" in out
