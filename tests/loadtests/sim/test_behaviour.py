"""The simulator's behaviour model, asserted on its /sim/stats counters (never on wall-clock time).

Each test runs a fresh simulated replica in-process behind a real HTTP server on loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from loadtests.sim.defaults import SimParams
from loadtests.sim.engine import SimEngine
from loadtests.sim.timeline import prompt_digest
from loadtests.sim.vllm_server import create_app
from tests.servers import write_adapter

FAST = SimParams(time_scale=0.001)
SimClient = TestClient[web.Request, web.Application]
Sim = Callable[..., AbstractAsyncContextManager[SimClient]]  # sim(preload=(...), **SimParams overrides)


@pytest.fixture
def adapter_dirs(tmp_path: Path) -> dict[str, str]:
    return {name: str(write_adapter(tmp_path / name, 8)) for name in ("a1", "a2", "a3", "a4")}


@pytest.fixture
def sim(adapter_dirs: dict[str, str]) -> Sim:
    @asynccontextmanager
    async def start(preload: tuple[str, ...] = ("a1", "a2", "a3"), **overrides: Any) -> AsyncIterator[SimClient]:
        engine = SimEngine(dataclasses.replace(FAST, **overrides), "base")
        app = create_app(engine, {name: adapter_dirs[name] for name in preload})
        # handler_cancellation as `tenantgate sim` runs it: a dropped client cancels its handler.
        async with TestClient(TestServer(app, handler_cancellation=True)) as client:
            yield client

    return start


async def complete(client: SimClient, model: str, prompt: str = "hello", max_tokens: int = 4) -> dict[str, Any]:
    response = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens})
    assert response.status == 200, await response.text()
    body: dict[str, Any] = await response.json()
    return body


async def stats(client: SimClient) -> dict[str, Any]:
    body: dict[str, Any] = await (await client.get("/sim/stats")).json()
    return body


async def paused(client: SimClient, paused: bool) -> None:
    assert (await client.post("/sim/control", json={"paused": paused})).status == 200


async def submit_in_order(client: SimClient, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Queue requests on a paused engine in exactly this order, then let it step; return the answers."""
    await paused(client, True)
    sent = []
    for index, body in enumerate(requests):
        sent.append(asyncio.create_task(client.post("/v1/completions", json=body)))
        for _ in range(500):  # bounded: each poll is one loopback round trip
            if (await stats(client))["waiting"] == index + 1:
                break
        else:
            pytest.fail("request did not reach the engine's queue")
    await paused(client, False)
    answers = []
    for task in sent:
        response = await task
        assert response.status == 200, await response.text()
        answers.append(await response.json())
    return answers


async def test_cold_load_is_counted_once_and_repeats_are_warm(sim: Sim) -> None:
    async with sim(preload=("a1",)) as client:
        assert (await stats(client))["cold_loads_by_adapter"] == {"a1": 1}  # --lora-modules reads from disk
        for _ in range(3):
            await complete(client, "a1")
        counters = await stats(client)
    assert counters["cold_loads"] == 1
    assert counters["swap_ins"] == 1  # host memory -> GPU slot once; later requests find it there
    assert counters["requests_by_model"] == {"a1": 3}


async def test_third_adapter_evicts_least_recently_used_idle_slot(sim: Sim) -> None:
    async with sim(max_loras=2) as client:
        for model in ("a1", "a2", "a1", "a3"):  # a2 is the least recently used when a3 needs a slot
            await complete(client, model)
        counters = await stats(client)
    assert counters["gpu_evictions"] == 1
    assert counters["gpu_resident"] == ["a1", "a3"]
    assert counters["swap_ins"] == 3


async def test_host_tier_overflow_reads_from_disk_again(sim: Sim) -> None:
    async with sim(preload=("a1", "a2", "a3"), max_loras=1, max_cpu_loras=2) as client:
        # Loading three adapters into a two-adapter host cache already evicted a1 from host memory.
        assert (await stats(client))["host_evictions"] == 1
        await complete(client, "a1")
        counters = await stats(client)
    assert counters["cold_loads_by_adapter"] == {"a1": 2, "a2": 1, "a3": 1}
    # The log says why each was read from disk and what it pushed out of host memory, oldest first.
    log = counters["cold_load_log"]
    assert [event[1:] for event in log] == [
        ["a1", "load", []],
        ["a2", "load", []],
        ["a3", "load", ["a1"]],
        ["a1", "request", ["a2"]],
    ]
    assert [event[0] for event in log] == sorted(event[0] for event in log)


async def test_request_waits_while_every_slot_is_busy(sim: Sim) -> None:
    async with sim(max_loras=1) as client:
        # a1 takes the only slot in the first step; a2 is skipped until a1's request finishes.
        await submit_in_order(client, [{"model": "a1", "prompt": "x"}, {"model": "a2", "prompt": "y"}])
        counters = await stats(client)
    assert counters["waits"] == {"lora_slot": 1}
    assert counters["queue_wait_s"] > 0
    assert counters["gpu_evictions"] == 1


async def test_waiting_adapter_is_overtaken_by_resident_ones(sim: Sim) -> None:
    async with sim(max_loras=1) as client:
        bodies = [{"model": m, "prompt": "x", "max_tokens": 2, "ignore_eos": True} for m in ("a1", "a2", "a1")]
        await submit_in_order(client, bodies)
        counters = await stats(client)
    assert counters["waits"] == {"lora_slot": 1}  # the second a1 request ran beside the first, a2 waited
    assert counters["swap_ins"] == 2


async def test_requests_beyond_batch_seats_queue(sim: Sim) -> None:
    async with sim(max_num_seqs=1) as client:
        await submit_in_order(client, [{"model": "a1", "prompt": "x"}, {"model": "a1", "prompt": "y"}])
        assert (await stats(client))["waits"] == {"batch": 1}


async def test_request_waits_for_kv_blocks(sim: Sim) -> None:
    async with sim(kv_blocks=8, block_size=16, max_model_len=128) as client:
        big = {"model": "a1", "prompt": " ".join(["abcd"] * 96), "max_tokens": 16, "ignore_eos": True}  # 7 blocks
        small = {"model": "a1", "prompt": " ".join(["wxyz"] * 20), "max_tokens": 8, "ignore_eos": True}  # 2 blocks
        await submit_in_order(client, [big, small])
        assert (await stats(client))["waits"] == {"kv": 1}


async def test_repeated_prompt_hits_the_prefix_cache_of_its_adapter_only(sim: Sim) -> None:
    prompt = " ".join(f"tok{i}" for i in range(64))  # 64 words of 4-5 chars: at least 64 tokens, 4+ blocks
    async with sim() as client:
        await complete(client, "a1", prompt)
        first = await stats(client)
        await complete(client, "a1", prompt)
        second = await stats(client)
        await complete(client, "a2", prompt)  # KV state computed under a1 is useless under a2
        third = await stats(client)
    assert first["prefix_hit_tokens"] == 0
    assert second["prefix_hit_tokens"] - first["prefix_hit_tokens"] >= 3 * 16
    assert third["prefix_hit_tokens"] == second["prefix_hit_tokens"]


async def test_same_seed_gives_same_counters(sim: Sim) -> None:
    async def run(seed: int) -> dict[str, Any]:
        async with sim(max_loras=2, max_cpu_loras=2, seed=seed, preload=("a1", "a2", "a3", "a4")) as client:
            outputs = [
                await complete(client, model, f"prompt {i}") for i, model in enumerate(["a1", "a3", "a2", "a4", "a1"])
            ]
            counters = await stats(client)
            del counters["request_headers"]  # their Host names each run's port
            # The cold-load log's times are the wall clock's; what happened must match.
            counters["cold_load_log"] = [event[1:] for event in counters["cold_load_log"]]
            counters["texts"] = [o["choices"][0]["text"] for o in outputs]
            return counters

    first, second, other_seed = await run(7), await run(7), await run(8)
    assert first == second
    assert first["texts"] != other_seed["texts"]
    assert first["busy_s"] != other_seed["busy_s"]  # cold-load jitter follows the seed too


async def test_ignore_eos_generates_exactly_max_tokens(sim: Sim) -> None:
    async with sim() as client:
        body = {"model": "a1", "prompt": "x", "max_tokens": 150, "ignore_eos": True}
        response = await client.post("/v1/completions", json=body)
        answer = await response.json()
    assert answer["usage"]["completion_tokens"] == 150
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_client_disconnect_mid_stream_aborts_the_engine_request(sim: Sim) -> None:
    async with sim() as client:
        await paused(client, True)
        body = {"model": "a1", "prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
        sending = asyncio.create_task(client.post("/v1/completions", json=body))
        await _until(client, lambda counters: counters["waiting"] == 1, "the request is queued")
        assert (await client.post("/sim/control", json={"run_steps": 1})).status == 200
        response = await sending
        assert (await response.content.readline()).startswith(b"data: ")  # the first token, then the engine holds
        held = await stats(client)
        assert (held["generation_tokens"], held["running"]) == (1, 1)
        response.close()
        await _until(client, lambda counters: counters["aborted"] == 1, "the request is aborted")
        counters = await stats(client)
    assert counters["running"] == 0
    assert counters["finished"] == 0


@pytest.mark.parametrize("steps", [-1, 1.5, True, "2"])
async def test_run_steps_refuses_what_is_not_a_step_count(sim: Sim, steps: object) -> None:
    async with sim() as client:
        response = await client.post("/sim/control", json={"run_steps": steps})
        assert response.status == 400
        assert "run_steps" in await response.text()


async def _until(client: SimClient, condition: Callable[[dict[str, Any]], bool], what: str) -> None:
    for _ in range(500):  # bounded: each poll is one loopback round trip
        if condition(await stats(client)):
            return
    pytest.fail(f"the engine never reached: {what}")


async def test_request_over_the_context_is_rejected_and_counted(sim: Sim) -> None:
    async with sim(max_model_len=64) as client:
        response = await client.post("/v1/completions", json={"model": "a1", "prompt": "x", "max_tokens": 100})
        assert response.status == 400
        counters = await stats(client)
    assert counters["rejected"] == 1
    assert counters["requests"] == 0


async def test_a_queued_request_is_served_after_its_adapter_is_unloaded(sim: Sim) -> None:
    """vLLM's unload only forgets the name: a request already accepted keeps its adapter (its LoRARequest) and is
    served. The simulator used to die on it (the engine loop raised on the missing name, every later request hung)."""
    async with sim(max_loras=1) as client:
        await paused(client, True)
        first = asyncio.create_task(complete(client, "a1"))
        queued = asyncio.create_task(complete(client, "a2"))
        await _until(client, lambda counters: counters["requests"] == 2, "both requests accepted")
        unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert unloaded.status == 200
        await paused(client, False)
        await asyncio.wait_for(asyncio.gather(first, queued), 10)
        assert (await complete(client, "a1"))["choices"]  # and the engine still serves


async def test_the_timeline_says_what_each_request_waited_for_and_the_stalls_between_steps(sim: Sim) -> None:
    """GET /sim/timeline (what bench_routing --tail splits the slowest requests by): per request at its first token,
    its prompt's digest and when it arrived, was admitted and got that token, with the reasons it waited; beside it
    the engine's stalls, each adapter read from disk (by the load API, or for a request whose adapter had left host
    memory) and each swap-in, in the order paid."""
    async with sim(preload=("a1", "a2", "a3"), max_loras=1, max_cpu_loras=2) as client:
        # Loading a3 pushed a1 out of host memory: a1's request reads it again (pushing a2 out, which its request
        # reads again in turn); a2's request waits for the one GPU slot.
        await submit_in_order(client, [{"model": "a1", "prompt": "x"}, {"model": "a2", "prompt": "y"}])
        timeline = await (await client.get("/sim/timeline")).json()
    requests = timeline["requests"]
    assert [(r["adapter"], r["digest"], r["waited_for"]) for r in requests] == [
        ("a1", prompt_digest("x"), []), ("a2", prompt_digest("y"), ["lora_slot"]),
    ]  # fmt: skip
    for r in requests:
        assert r["arrived"] <= r["admitted"] <= r["first_token"]
    assert requests[0]["admitted"] < requests[1]["admitted"]
    stalls = timeline["stalls"]
    assert [(kind, adapter) for _, _, kind, adapter in stalls] == [
        ("load", "a1"), ("load", "a2"), ("load", "a3"), ("load", "a1"), ("swap", "a1"), ("load", "a2"), ("swap", "a2"),
    ]  # fmt: skip
    for (start, end, _, _), (after, _, _, _) in itertools.pairwise(stalls):
        assert start <= end <= after
