"""Metrics under ``serve --workers`` (gateway/observe/shared_metrics.py): each worker adds to its values in the
process and writes them to prometheus-client's multiprocess files when it flushes; any worker's exposition then
merges every worker's files: counters and histograms summed per series and bucket, gauges per worker (a pid label),
the answering worker's own collectors once. Each worker here is a real process (the value class is chosen per
process, before its first metric), sharing one directory as the supervisor's workers do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# One worker: records a request's metrics (through the request path's writers and through the public API), then
# flushes (FLUSH), exits without flushing (EXIT: the exit flushes), or prints its exposition (ANSWER).
WORKER = """
import os, sys
from prometheus_client.core import GaugeMetricFamily
from gateway.observe import shared_metrics
from gateway.observe.metrics import GatewayMetrics, adder, observer

class Live:
    def collect(self):
        yield GaugeMetricFamily("live_reading", "read at scrape time", value=os.getpid())

mode, amount = sys.argv[1], float(sys.argv[2])
metrics = GatewayMetrics()
metrics.watch(Live())
adder(metrics.requests.labels("acme", "a1", "llama", "r0", "200"))(amount)
metrics.completion_tokens.labels("acme", "a1").inc(10 * amount)
observer(metrics.duration.labels("acme", "a1", "llama"))(0.02)
metrics.duration.labels("acme", "a1", "llama").observe(3.0)
metrics.client_connections.labels("open").set(amount)
files = sorted(os.listdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]))
if mode == "FLUSH":
    before = {name: open(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], name), "rb").read() for name in files}
    shared_metrics.flush()
    after = {name: open(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], name), "rb").read() for name in files}
    print("unchanged until the flush" if all(before[n] != after[n] for n in files) else "written before the flush")
elif mode == "ANSWER":
    sys.stdout.write(metrics.exposition().decode())
elif mode == "RELOADED_TWICE":
    # A reload found a restart-only setting changed, then one that found none (the file put back), each followed by
    # a flush (its timer's), then a scrape.
    metrics.restart_pending(["listen.port"])
    shared_metrics.flush()
    metrics.restart_pending([])
    shared_metrics.flush()
    sys.stdout.write(metrics.exposition().decode())
elif mode == "ANSWER_AS_A_DEAD_WORKERS_GAUGES_GO":
    # The supervisor removes a dead worker's gauge file between the collector's listing and its read of it.
    from prometheus_client import multiprocess
    read = multiprocess.MmapedDict.read_all_values_from_file
    def read_after_removal(path):
        if os.path.basename(path).startswith("gauge_all_") and not path.endswith(f"_{os.getpid()}.db"):
            os.unlink(path)
        return read(path)
    multiprocess.MmapedDict.read_all_values_from_file = staticmethod(read_after_removal)
    sys.stdout.write(metrics.exposition().decode())
elif mode == "ANSWER_AS_A_NEW_WORKER_OPENS_ITS_FILE":
    # A replacement worker has opened its counter file and not yet sized it (prometheus-client opens it empty).
    open(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "counter_999999.db"), "ab").close()
    sys.stdout.write(metrics.exposition().decode())
"""


# A worker's app (gateway/app.py) left running, never scraped: its own timer writes what it counted to its file
# within FLUSH_S, and this prints how long that took (or "never" after 20 flush periods).
APP_WORKER = """
import asyncio, glob, os, sys, time
from aiohttp import web
from gateway.app import create_app
from gateway.appkeys import METRICS
from gateway.config import GatewayConfig
from gateway.observe.shared_metrics import FLUSH_S
from loadtests.fleet import gateway_config

async def main():
    config = gateway_config({"r0": "http://127.0.0.1:9"}, {"acme": ["a1"]}, {"a1": "/srv/loras/a1"}, port=0)
    app = create_app(GatewayConfig.model_validate(config))
    runner = web.AppRunner(app)
    await runner.setup()  # the app's cleanup contexts start: its timers among them
    try:
        counter = app[METRICS].requests.labels("acme", "a1", "llama", "r0", "200")  # its entry made in the file
        [path] = glob.glob(os.path.join(os.environ["PROMETHEUS_MULTIPROC_DIR"], "counter_*.db"))
        before = open(path, "rb").read()
        counter.inc()
        started = time.monotonic()
        while time.monotonic() - started < 20 * FLUSH_S:  # bounded: the timer's period is FLUSH_S
            if open(path, "rb").read() != before:
                print("written after", round(time.monotonic() - started, 2), "s")
                return
            await asyncio.sleep(FLUSH_S / 10)
        print("never")
    finally:
        await runner.cleanup()

asyncio.run(main())
"""


def _worker(directory: Path, mode: str, amount: float) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory), "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", WORKER, mode, str(amount)], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result


def _samples(text: str, name: str) -> list[Sample]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def test_a_value_is_written_at_the_flush_not_at_each_increment(tmp_path: Path) -> None:
    assert _worker(tmp_path, "FLUSH", 1).stdout.strip() == "unchanged until the flush"


def test_any_workers_exposition_merges_every_workers_values(tmp_path: Path) -> None:
    _worker(tmp_path, "FLUSH", 1)  # flushed by its timer or a scrape's ask
    _worker(tmp_path, "EXIT", 2)  # a worker that ended (its exit flushes): its counts stay in the sums
    text = _worker(tmp_path, "ANSWER", 4).stdout  # the answering worker: its own values up to now

    [requests] = _samples(text, "tenantgate_requests_total")
    assert requests.value == 1 + 2 + 4
    [tokens] = _samples(text, "tenantgate_completion_tokens_total")
    assert tokens.value == 70
    buckets = {s.labels["le"]: s.value for s in _samples(text, "tenantgate_request_duration_seconds_bucket")}
    assert buckets["0.01"] == 0 and buckets["0.025"] == 3 and buckets["2.5"] == 3 and buckets["5.0"] == 6
    assert buckets["+Inf"] == 6
    [count] = _samples(text, "tenantgate_request_duration_seconds_count")
    assert count.value == 6
    [total] = _samples(text, "tenantgate_request_duration_seconds_sum")
    assert abs(total.value - 3 * 3.02) < 1e-9
    gauges = sorted(s.value for s in _samples(text, "tenantgate_client_connections"))
    assert gauges == [1, 2, 4]  # one per worker, each with its pid
    assert len({s.labels["pid"] for s in _samples(text, "tenantgate_client_connections")}) == 3
    assert len(_samples(text, "live_reading")) == 1  # a collector read at scrape time: the answering worker's own


def test_a_dead_workers_gauges_removed_during_a_scrape_leave_it_whole(tmp_path: Path) -> None:
    _worker(tmp_path, "EXIT", 2)
    text = _worker(tmp_path, "ANSWER_AS_A_DEAD_WORKERS_GAUGES_GO", 4).stdout
    assert [s.value for s in _samples(text, "tenantgate_client_connections")] == [4]  # the living worker's only
    [requests] = _samples(text, "tenantgate_requests_total")
    assert requests.value == 2 + 4  # the dead worker's counts stay


def test_a_scrape_while_a_new_worker_opens_its_file_answers(tmp_path: Path) -> None:
    """The supervisor replaced a worker and the scrape lists the new one's file before it is sized: it once
    answered 500 (struct.error reading an empty file) in test_workers' killed-worker test."""
    text = _worker(tmp_path, "ANSWER_AS_A_NEW_WORKER_OPENS_ITS_FILE", 3).stdout
    [requests] = _samples(text, "tenantgate_requests_total")
    assert requests.value == 3


def test_a_workers_app_writes_its_counts_every_flush_period_without_a_scrape(tmp_path: Path) -> None:
    """docs/operations.md, several workers: each worker writes its values to the files every FLUSH_S (0.5 s), not
    only when it stops or a scrape asks; a worker killed outright loses at most that period's counts."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", APP_WORKER], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    answer = result.stdout.strip().splitlines()[-1]
    assert answer.startswith("written after"), answer  # within 20 periods (a bounded poll), with no scrape


def test_a_setting_no_longer_pending_a_restart_reads_0_not_its_last_1(tmp_path: Path) -> None:
    """tenantgate_config_restart_pending under --workers: a gauge's series lives in the worker's file, so a reload
    that finds nothing pending must write 0 there (clearing the series in the process left the file's 1 for good)."""
    text = _worker(tmp_path, "RELOADED_TWICE", 0).stdout
    pending = {s.labels["field"]: s.value for s in _samples(text, "tenantgate_config_restart_pending")}
    assert pending == {"listen.port": 0}
