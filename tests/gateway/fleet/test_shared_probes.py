"""Under serve --workers one worker probes the engines for the host's workers (gateway/fleet/host_scrape.py): what
a worker that does not probe does with the rounds it hears."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from backends.base import Endpoint
from gateway.config import GatewayConfig
from gateway.fleet.fleet import Fleet
from gateway.fleet.host_scrape import HostScrapes
from gateway.tenants.identity import hash_key
from gateway.workers import WorkerSockets
from tests.gateway.residency.fakes import FakeDriver, FakeEngine


class Follower(HostScrapes):
    """A worker that does not probe, and heard the probing worker's latest round of every pool just now."""

    def __init__(self, round_: Mapping[str, bool]) -> None:
        super().__init__(WorkerSockets(worker=1, workers=2, listen_fd=-1, operator_fd=None, directory=Path("/")))
        self.round = dict(round_)

    def probes_heard(self, pool: str, within_s: float) -> bool:
        return True

    def probes_named(self, pool: str) -> frozenset[str]:
        return frozenset(self.round)


class Counting(FakeDriver):
    def __init__(self, engine: FakeEngine) -> None:
        super().__init__(engine)
        self.probed: list[str] = []

    async def healthy(self, replica: Endpoint) -> bool:
        self.probed.append(replica.id)
        return await super().healthy(replica)


def two_replicas() -> GatewayConfig:
    replicas = [{"id": "r0", "url": "http://127.0.0.1:1"}, {"id": "r1", "url": "http://127.0.0.1:2"}]
    return GatewayConfig.model_validate(
        {
            "pools": [{"name": "llama", "backend": "vllm", "base_model": "tiny-llama", "replicas": replicas}],
            "tenants": [{"id": "acme", "api_keys": [hash_key("k")], "base_models": ["tiny-llama"]}],
        }
    )


async def test_a_replica_the_probing_workers_round_does_not_name_is_probed_by_the_worker_that_has_it() -> None:
    """Each worker discovers replicas and reloads on its own (DNS answering workers differently, a reload with
    ?scope=local): a replica that the probing worker does not have, or has at another URL, is in no round it sends.
    The other worker heard rounds of the pool, so it probed none of it: that replica's health stayed what its
    start-up probe said, for as long as the two differed. It probes that replica itself; the rest come from the
    rounds, taken only for a replica at the URL the round probed."""
    fleet = Fleet(two_replicas())
    pool = fleet.pools["llama"]
    engine = FakeEngine()
    pool.driver = driver = Counting(engine)
    try:
        engine.down.add("r1")
        fleet.scrapes = Follower({"http://127.0.0.1:1": True})  # the probing worker has r0 alone
        await fleet._probe(pool)
        assert driver.probed == ["r1"] and not pool.replicas["r1"].healthy
        # A round taken: r0 by its URL; a replica at another URL is not r1, whatever its id there.
        pool.took_probes({"http://127.0.0.1:1": False, "http://127.0.0.1:9": True})
        assert not pool.replicas["r0"].healthy and not pool.replicas["r1"].healthy
    finally:
        await fleet.close()


async def test_a_worker_probes_for_itself_after_three_rounds_time_of_silence_and_not_before() -> None:
    """docs/operations.md and docs/architecture.md: a worker that has heard no probe round of a pool for
    ``3 x (interval_s + timeout_s)`` probes it itself. Its real ``probes_heard``, with the last round heard just
    inside that window (the round names both replicas: nothing probed here) and just past it (both probed)."""
    config = two_replicas()
    fleet = Fleet(config)
    pool = fleet.pools["llama"]
    pool.driver = driver = Counting(FakeEngine())
    health = config.pools[0].health
    window = 3 * (health.interval_s + health.timeout_s)
    scrapes = HostScrapes(WorkerSockets(worker=1, workers=2, listen_fd=-1, operator_fd=None, directory=Path("/")))
    scrapes._probed["llama"] = frozenset({"http://127.0.0.1:1", "http://127.0.0.1:2"})
    fleet.scrapes = scrapes
    try:
        scrapes._probed_at["llama"] = time.monotonic() - (window - 0.5)
        await fleet._probe(pool)
        assert driver.probed == []
        scrapes._probed_at["llama"] = time.monotonic() - (window + 0.5)
        await fleet._probe(pool)
        assert sorted(driver.probed) == ["r0", "r1"]
    finally:
        await fleet.close()
