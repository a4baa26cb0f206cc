"""Under serve --workers a worker's Unix datagram socket (gateway/fleet/host_scrape.py) takes the probing worker's
scrapes and probe rounds. What arrives there that no sibling sends (garbage, a decompression bomb, wrong types,
nesting past the parser's depth, a replayed or reordered datagram) is ignored: it never raises out of the reader,
never reaches the pool's load view or health, so it cannot take the worker down or eject a replica."""

from __future__ import annotations

import json
import logging
import socket
import time
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from backends.base import EngineLoad
from gateway.config import GatewayConfig
from gateway.fleet import host_scrape
from gateway.fleet.fleet import Fleet
from gateway.fleet.host_scrape import HostScrapes
from gateway.tenants.identity import hash_key
from gateway.workers import WorkerSockets

R0, R1 = "http://127.0.0.1:1", "http://127.0.0.1:2"


def two_replicas() -> GatewayConfig:
    replicas = [{"id": "r0", "url": R0}, {"id": "r1", "url": R1}]
    return GatewayConfig.model_validate(
        {
            "pools": [{"name": "llama", "backend": "vllm", "base_model": "tiny-llama", "replicas": replicas}],
            "tenants": [{"id": "acme", "api_keys": [hash_key("k")], "base_models": ["tiny-llama"]}],
        }
    )


class Worker:
    """A following worker's inbox, wired to a real fleet as the app wires it, and a socket to send it datagrams."""

    def __init__(self, directory: Path, fleet: Fleet) -> None:
        self.fleet = fleet
        self.scrapes = HostScrapes(
            WorkerSockets(worker=1, workers=2, listen_fd=-1, operator_fd=None, directory=directory)
        )
        inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.path = str(self.scrapes.sockets.socket_path("scrapes"))
        inbox.bind(self.path)
        inbox.setblocking(False)
        self.scrapes._inbox = inbox
        self.scrapes._apply = lambda pool, at, loads: fleet.pools[pool].took_scrape(at, loads)
        self.scrapes._apply_probes = lambda pool, healthy: fleet.pools[pool].took_probes(healthy)
        self.sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def receive(self, *datagrams: bytes) -> None:
        for data in datagrams:
            self.sender.sendto(data, self.path)
        self.scrapes._received()  # what the event loop calls when the inbox is readable

    def close(self) -> None:
        self.sender.close()
        assert self.scrapes._inbox is not None
        self.scrapes._inbox.close()


@pytest.fixture
async def worker(tmp_path: Path) -> AsyncIterator[Worker]:
    fleet = Fleet(two_replicas())
    here = Worker(tmp_path, fleet)
    yield here
    here.close()
    await fleet.close()


def packed(message: Any) -> bytes:
    return zlib.compress(json.dumps(message).encode())


def scrape(at: float, running: Any = 1.0, **fields: Any) -> dict[str, Any]:
    load = {"running": running, "waiting": 0, "kv_cache_usage": 0.1, "running_adapters": [], "gpu_slots": 4}
    load["generated_tokens"] = None
    load.update(fields)
    return {"pool": "llama", "at": at, "worker": 0, "replicas": {"r0": load}}


def probes(healthy: dict[str, Any], at: float | None = None) -> dict[str, Any]:
    return {"kind": "probes", "pool": "llama", "worker": 0, "healthy": healthy, "at": at or time.monotonic()}


HOSTILE = {
    "garbage": b"\x00\xff garbage",
    "compressed text": zlib.compress(b"not json"),
    "a list": packed([1, 2]),
    "nested past the parser": zlib.compress(b"[" * 200_000),
    "a string where a figure is": packed(scrape(1.0, running="many")),
    "a huge integer": packed(scrape(1.0, running=10**400)),
    "a negative figure": packed(scrape(1.0, running=-5)),
    "a boolean figure": packed(scrape(1.0, running=True)),
    "adapters not a list": packed(scrape(1.0, running_adapters=5)),
    "an adapter not a string": packed(scrape(1.0, running_adapters=[["a"]])),
    "an unknown field": packed(scrape(1.0, gpu=1)),
    "gpu slots a fraction": packed(scrape(1.0, gpu_slots=2.5)),
    "replicas a list": packed({"pool": "llama", "at": 1.0, "worker": 0, "replicas": ["r0"]}),
    "a pool not a string": packed({"pool": ["llama"], "at": 1.0, "worker": 0, "replicas": {}}),
    "at not finite": packed({**scrape(1.0), "at": "inf"}),
    "at in the future": packed(scrape(1e12)),
    "health not a boolean": packed(probes({R0: None, R1: "no"})),
    "health a list": packed({**probes({}), "healthy": [R0]}),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_datagram_is_ignored_and_changes_nothing(
    worker: Worker, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    pool = worker.fleet.pools["llama"]
    for _ in range(5):  # a replica's health changes after a few failed probes in a row: five cannot eject one
        worker.receive(HOSTILE[name])
    assert all(replica.healthy for replica in pool.replicas.values())
    assert pool.replicas["r0"].engine_load is None
    assert "unreadable message from a sibling worker" in caplog.text
    worker.receive(packed(scrape(time.monotonic(), running=3)))  # the next good one is taken
    assert pool.replicas["r0"].engine_load is not None and pool.replicas["r0"].engine_load.running == 3


def test_a_decompression_bomb_is_not_inflated_past_the_bound(
    worker: Worker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A datagram under the 1 MiB a receive takes can inflate a thousandfold: 64 MiB of JSON here, parsed on the
    event loop. It is refused once it decompresses past host_scrape._MAX_MESSAGE, before any parse."""
    parsed: list[int] = []
    loads = json.loads

    def measured(text: bytes) -> Any:
        parsed.append(len(text))
        return loads(text)

    monkeypatch.setattr(json, "loads", measured)
    bomb = zlib.compress(b'{"pool": "llama", "pad": "' + b"0" * (64 << 20) + b'"}', 9)
    assert len(bomb) < 1 << 20
    worker.receive(bomb)
    assert parsed == [] and "unreadable message from a sibling worker" in caplog.text


def test_a_replayed_or_older_scrape_does_not_replace_a_newer_one(worker: Worker) -> None:
    pool = worker.fleet.pools["llama"]
    now = time.monotonic()
    old, new = packed(scrape(now - 1.0, running=9)), packed(scrape(now, running=2))
    worker.receive(old, new)
    worker.receive(old)  # replayed (or arriving late)
    load = pool.replicas["r0"].engine_load
    assert load is not None and load.running == 2 and pool.replicas["r0"].scraped_at == now
    worker.receive(new)  # the newest again: not taken twice either (its in-flight count stays the one taken then)
    load = pool.replicas["r0"].engine_load
    assert load is not None and load.running == 2 and pool.replicas["r0"].scraped_at == now


def test_a_replayed_probe_round_counts_once(worker: Worker) -> None:
    """A round saying a replica is down, replayed, counted as as many failed probes: enough in a row eject it."""
    pool = worker.fleet.pools["llama"]
    worker.receive(packed(probes({R0: True, R1: True}, time.monotonic() - 1.0)))  # the first round sets the state
    down = packed(probes({R0: False, R1: True}))
    for _ in range(10):
        worker.receive(down)
    assert pool.replicas["r0"].healthy


def test_the_unreadable_are_logged_once_a_minute_not_each(worker: Worker, caplog: pytest.LogCaptureFixture) -> None:
    """A flood of junk cost a log line each; now the first is said, then a count at most once a minute."""
    with caplog.at_level(logging.WARNING):
        for _ in range(50):
            worker.receive(b"junk")
    assert caplog.text.count("unreadable message from a sibling worker") == 1


def test_a_good_scrape_and_round_still_read_back() -> None:
    loads: dict[str, EngineLoad | None] = {"r0": EngineLoad(2, 3, 0.5, frozenset({"a"}), gpu_slots=4), "r1": None}
    at = time.monotonic()
    assert host_scrape.decode(host_scrape.encode("p", at, 1, loads)) == ("p", at, 1, loads)
    assert host_scrape.decode_probes(host_scrape.encode_probes("p", 1, {R0: True}, at)) == ("p", 1, {R0: True})
