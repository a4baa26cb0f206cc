"""The locust load test, short: it runs headless, writes its reports with a row per tenant, and nothing fails."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from loadtests.loadtest import run

pytestmark = pytest.mark.timeout(180)


def test_a_short_burst_loadtest_writes_per_tenant_reports_and_fails_nothing(tmp_path: Path) -> None:
    assert run(seconds=8, users=6, shape="burst", tenants=8, out=tmp_path) == 0
    with (tmp_path / "loadtest_stats.csv").open() as stats:
        rows = list(csv.DictReader(stats))
    tenants = {row["Name"].split("/")[0] for row in rows if row["Name"] != "Aggregated"}
    aggregated = next(row for row in rows if row["Name"] == "Aggregated")
    assert len(tenants) >= 3 and int(aggregated["Request Count"]) > 50
    assert int(aggregated["Failure Count"]) == 0
    assert (tmp_path / "loadtest.html").stat().st_size > 0
