"""The locust load test, short: it runs headless, writes its reports with a row per tenant, and nothing fails."""

from __future__ import annotations

import csv
import subprocess
import sys
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


# Run in a process of its own: importing locust patches the standard library for gevent, which this one must not get.
HELD = """
import gc
from types import SimpleNamespace
from locust import events
import loadtests.locustfile

assert gc.isenabled()
events.test_start.fire(environment=None)
assert not gc.isenabled(), "a test started with the collector on"
events.test_start.fire(environment=None)  # a restart from locust's web UI: still one hold
events.test_stop.fire(environment=None)
assert gc.isenabled(), "the collector is not back after the test"
events.test_start.fire(environment=None)
quiet = SimpleNamespace(stats=SimpleNamespace(total=SimpleNamespace(num_failures=0)))  # what _fail_on_errors reads
events.quitting.fire(environment=quiet)
assert gc.isenabled(), "the collector is not back after locust quit mid-test"
"""


def test_locust_times_its_requests_with_the_collector_held_off_from_start_to_stop() -> None:
    """loadtests/collector.py: a collection's pause in the client is read as the gateway's latency by every request
    in flight, so the locustfile holds the collector off while a test runs, as the routing benchmarks do."""
    done = subprocess.run([sys.executable, "-c", HELD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
