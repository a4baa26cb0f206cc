"""The overhead benchmark's parts: the bare proxy relays to a replica, CPU is summed over a process tree, and the
profile's summary ranks functions by their own samples."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from aiohttp.test_utils import TestServer

from loadtests.bare_proxy import make_app
from loadtests.bench_overhead import (
    Result,
    Running,
    _added,
    _measure,
    _preload,
    _top_functions,
    peer,
    tenantgate,
    tree_cpu_s,
)
from loadtests.bench_routing import PEERS
from loadtests.fleet import gateway_config, process_cpu_s, simulated_replicas, write_adapters
from loadtests.processes import free_port, running
from tests.redis_server import RedisServer
from tests.servers import EngineProcess


@pytest.mark.parametrize("upstream", ["aiohttp", "http1"])
async def test_the_bare_proxy_relays_a_completion(sim_engine: EngineProcess, upstream: str) -> None:
    body = {"model": "a1", "prompt": "x", "max_tokens": 2}
    async with (
        TestServer(make_app([sim_engine.url], upstream), host="127.0.0.1") as server,
        httpx.AsyncClient(base_url=str(server.make_url("/"))) as client,
    ):
        answer = await client.post("/v1/completions", json=body, headers={"x-tenant-id": "acme"}, timeout=30)
    assert answer.status_code == 200 and answer.json()["choices"]


def test_the_fast_bare_proxy_relays_completions_in_order_on_one_connection(sim_engine: EngineProcess) -> None:
    """``bare-fast``'s server: two requests pipelined on one connection, each relayed, answered in order; the last
    asks to close and the connection ends after its answer."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "loadtests.bare_proxy", "--port", str(port), "--client", "http1", "--server", "fast"]
    with running([*cmd, sim_engine.url], url, Path(os.devnull), start_timeout_s=30):
        one, two = (json.dumps({"model": "a1", "prompt": "x", "max_tokens": n}).encode() for n in (1, 3))
        heads = [
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"x-tenant-id: acme\r\n%sContent-Length: %d\r\n\r\n" % (close, len(body))
            for close, body in ((b"", one), (b"Connection: close\r\n", two))
        ]
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(heads[0] + one + heads[1] + two)
            received = b""
            while chunk := conn.recv(65536):
                received += chunk
    answers = [json.loads(part.split(b"\r\n\r\n", 1)[1]) for part in received.split(b"HTTP/1.1 ")[1:]]
    assert received.startswith(b"HTTP/1.1 200") and received.count(b"HTTP/1.1 200") == 2
    assert [a["usage"]["completion_tokens"] for a in answers] == [1, 3]


def test_added_latency_at_one_client_is_measured_against_the_direct_requests_sent_in_turns() -> None:
    """Where a setup's requests at one client went in turns with direct ones, its added latency is measured against
    those; elsewhere against the direct run's row."""
    results = [
        Result("direct", "realistic", 1, 500.0, 2.0, 9.0, 0.0),
        Result("tenantgate", "realistic", 1, 400.0, 1.5, 4.0, 500.0, paired_p50_ms=1.0, paired_p99_ms=3.0),
        Result("direct", "realistic", 64, 5000.0, 10.0, 20.0, 0.0),
        Result("tenantgate", "realistic", 64, 2000.0, 25.0, 60.0, 250.0),
    ]
    _added(results)
    assert (results[1].added_p50_ms, results[1].added_p99_ms) == (0.5, 1.0)
    assert (results[3].added_p50_ms, results[3].added_p99_ms) == (15.0, 40.0)


def test_a_setup_at_one_client_is_measured_in_turns_with_direct_requests(sim_engine: EngineProcess) -> None:
    sent: list[str] = []

    def target(who: str) -> Callable[[str, str], tuple[str, dict[str, str], bytes]]:
        def one(tenant: str, adapter: str) -> tuple[str, dict[str, str], bytes]:
            sent.append(who)
            body = json.dumps({"model": adapter, "prompt": "x", "max_tokens": 1}).encode()
            return sim_engine.url + "/v1/completions", {"Content-Type": "application/json"}, body

        return one

    result = _measure("setup", "realistic", Running(target("setup")), {"t": ["a1"]}, 12, 1, Running(target("direct")))
    assert result.paired_p50_ms is not None and result.paired_p50_ms > 0 and result.requests_per_s > 0
    assert 0 < result.p50_ms <= result.p90_ms <= result.p99_ms
    assert sent == ["setup", "direct"]  # a target per tenant, asked once each: the turns reuse them


def test_cpu_is_summed_over_the_process_and_its_children() -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint(1, flush=True)\n"
    with subprocess.Popen(
        [sys.executable, "-c", spin + "input()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as child:
        assert child.stdout is not None and child.stdin is not None
        child.stdout.readline()  # it has spun for 0.3 s of CPU and waits
        assert tree_cpu_s([os.getpid()]) >= process_cpu_s(os.getpid()) + 0.25
        child.stdin.close()


def test_the_profile_summary_ranks_functions_by_own_samples(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "run (loop.py:1);handle (app.py:10);encode (json.py:5) 30\n"
        "run (loop.py:1);handle (app.py:10) 10\n"
        "run (loop.py:1);poll (loop.py:9) 60\n"
    )
    lines = _top_functions(raw)
    assert lines[0].startswith("100 samples")
    assert lines[1].split() == ["60.0", "60.0", "poll", "(loop.py:9)"]
    assert lines[2].split() == ["30.0", "30.0", "encode", "(json.py:5)"]
    assert lines[3].split() == ["10.0", "40.0", "handle", "(app.py:10)"]


@pytest.mark.skipif(not (PEERS / "vllm-router" / "bin").exists(), reason="vllm-router not installed (make peers)")
def test_a_peer_finds_every_adapter_though_a_gateway_before_it_unloaded_some(tmp_path: Path) -> None:
    """tenantgate's runs trim each replica's adapters back to its max_adapters before the peers run on the same
    replicas; a peer routes without loading adapters, so it must find them all loaded again."""
    adapters = write_adapters(tmp_path, ["lora-t00", "lora-b"])  # lora-t00: what the peer is first asked for
    with simulated_replicas(tmp_path, 1, "--time-scale", "0") as urls:
        replica = urls["r0"]
        _preload([replica], adapters)
        unload = json.dumps({"lora_name": "lora-t00"}).encode()
        request = urllib.request.Request(
            replica + "/v1/unload_lora_adapter", unload, {"Content-Type": "application/json"}
        )
        urllib.request.urlopen(request, timeout=10).close()  # as the gateway's trim does
        with peer("vllm-router", [replica], tmp_path, adapters) as serving:
            url, headers, body = serving.target("t01", "lora-b")
            answer = httpx.post(url, content=body, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text


def test_a_profile_of_workers_samples_a_worker_not_the_supervisor(sim_engine: EngineProcess, tmp_path: Path) -> None:
    with RedisServer(log_path=tmp_path / "redis.log") as redis:
        extra = {"state": {"redis_url": redis.url}}
        adapters = {"a1": sim_engine.adapters["a1"]}
        config = gateway_config({"r0": sim_engine.url}, {"acme": ["a1"]}, adapters, port=free_port(), extra=extra)
        with tenantgate(tmp_path, "workers", config, workers=2) as serving:
            supervisor, profiled = serving.pids[0], serving.profiled_pid()
            status = Path(f"/proc/{profiled}/status").read_text()
    assert profiled != supervisor
    assert f"PPid:\t{supervisor}\n" in status  # one of the supervisor's workers
