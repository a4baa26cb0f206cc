"""The admin documents of serve --workers' workers merged into one: what adds up is added, health is never rosier
than one worker's, TTFT percentiles are read again from every worker's samples."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.admin.merge import merge_residency, merge_state
from gateway.admin.siblings import Siblings
from gateway.workers import WorkerSockets


def _state(worker: int, in_flight: int, healthy: bool, ttft_ms: list[float], at: float) -> dict[str, Any]:
    replica = {
        "id": "r0", "healthy": healthy, "up": True, "drained": False, "ejected": not healthy, "in_flight": in_flight,
        "load_view": in_flight + 3, "engine_load": None, "loading": ["b"] if worker else [],
        "adapters": {"a": {"idle_s": 5.0 - worker, "pinned": bool(worker), "in_flight": in_flight}},
    }  # fmt: skip
    minute = {"minute": 60, "requests": len(ttft_ms), "cold_loads": worker, "ttft_ms": ttft_ms}
    return {
        "at": 1.0, "store": "up", "pools": {"p": {"replicas": [replica], "tenants": []}},
        "adapters": {"a": [minute]}, "decisions": [{"at": at, "worker": worker}],
        "worker": {"worker": worker, "pid": 100 + worker, "in_flight": in_flight, "scrapes_engines": worker == 0},
    }  # fmt: skip


def test_the_state_of_two_workers_adds_up_and_keeps_each_workers_own() -> None:
    merged = merge_state(_state(0, 2, True, [10.0, 20.0], at=5.0), [_state(1, 3, False, [30.0], at=6.0)], [2])
    [replica] = merged["pools"]["p"]["replicas"]
    assert replica["in_flight"] == 5
    assert replica["healthy"] is False and replica["ejected"] is True  # worker 1 ejected it
    assert replica["by_worker"] == {
        "0": {"in_flight": 2, "load_view": 5, "healthy": True, "ejected": False},
        "1": {"in_flight": 3, "load_view": 6, "healthy": False, "ejected": True},
    }
    assert replica["adapters"] == {"a": {"idle_s": 4.0, "pinned": True, "in_flight": 5}}
    assert replica["loading"] == ["b"]
    [minute] = merged["adapters"]["a"]
    assert (minute["requests"], minute["cold_loads"], minute["ttft_p50_ms"]) == (3, 1, 20.0)
    assert [d["worker"] for d in merged["decisions"]] == [1, 0]  # newest first
    assert merged["answered_by"] == 0 and merged["missing_workers"] == [2]
    assert [w["pid"] for w in merged["workers"]] == [100, 101]
    assert "worker" not in merged


def test_the_residency_of_two_workers_adds_counters_and_ejections() -> None:
    def residency(worker: int, hits: int, ejections: int) -> dict[str, Any]:
        replica: dict[str, Any] = {
            "healthy": True, "up": True, "ejected": False, "ejection_reason": None, "ejections": ejections,
            "ejected_for_s": 0.0, "weight": 1.0 - worker / 2, "loading": [],
            "adapters": {"a": {"idle_s": 1.0, "pinned": False, "in_flight": worker}},
        }  # fmt: skip
        return {
            "store": "up" if worker == 0 else "down",
            "pools": {"p": {"max_adapters": 2, "counters": {"hits": hits}, "replicas": {"r0": replica}}},
            "worker": {"worker": worker, "pid": 1, "in_flight": 0, "scrapes_engines": False},
        }

    merged = merge_residency(residency(0, 4, 1), [residency(1, 6, 2)], [])
    pool = merged["pools"]["p"]
    assert pool["counters"] == {"hits": 10}
    assert pool["replicas"]["r0"]["ejections"] == 3
    assert pool["replicas"]["r0"]["weight"] == 0.5
    assert pool["replicas"]["r0"]["adapters"]["a"]["in_flight"] == 1
    assert merged["store"] == "down"


async def test_a_worker_that_does_not_answer_within_2_s_is_named_missing_not_waited_for(tmp_path: Path) -> None:
    """docs/operations.md, Every core: the worker answering an admin request lists under missing_workers those
    that did not answer within 2 s; here worker 1 accepts the question and never answers."""
    sockets = WorkerSockets(0, 2, -1, None, tmp_path)
    held: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # reads nothing, answers nothing, keeps the connection open

    server = await asyncio.start_unix_server(silent, path=str(sockets.socket_path("admin", 1)))
    siblings = Siblings(web.Application(), sockets)
    try:
        started = time.monotonic()
        assert await siblings._ask(1, "state") is None
        assert 1.9 <= time.monotonic() - started < 10  # it waited out its 2 s (to the clock's grain), no longer
    finally:
        for session in siblings._sessions.values():
            await session.close()
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()
