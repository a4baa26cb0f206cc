"""A slot one gateway frees ends another gateway's wait for it at once: two `tenantgate serve` processes sharing a
real redis-server, one simulated Triton replica whose PEFT cache holds one adapter (TensorRT-LLM refuses a load
into a full cache, so the gateways wait for a slot), the `openai` SDK as the client.

The in-use window is 10 s (a use flush every 2.5 s) and the slot wait 3 s: without the release through Redis,
gateway B sees the slot A's request held as free only when A's use mark leaves the window, and its wait gives up
first (503). What happened is read from the engine's own counters and the gateways' metrics. The rounds are
``loadtests/bench_slot_release_serve.py``'s, which prints the release-to-load figures over many of them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from backends.lora_weights import task_id
from loadtests.bench_slot_release_serve import ADMIN, metric, one_round, two_gateways_on_one_triton_slot
from loadtests.fleet import api_key, sim_stats
from tests.redis_server import RedisServer

pytestmark = pytest.mark.timeout(180)

RESIDENCY = {"use_flush_interval_s": 2.5, "slot_wait_timeout_s": 3.0, "fill_free_slots": False}


def test_a_wait_on_one_gateway_ends_when_another_gateways_request_frees_the_slot(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    with two_gateways_on_one_triton_slot(tmp_path, redis_server.url, RESIDENCY) as (replica, (a, b), adapters):
        ta = openai.AsyncOpenAI(base_url=a + "/v1", api_key=api_key("ta"), max_retries=0, timeout=30)
        tb = openai.AsyncOpenAI(base_url=b + "/v1", api_key=api_key("tb"), max_retries=0, timeout=30)
        x, y = task_id("x", adapters["x"]), task_id("y", adapters["y"])

        async def scenario() -> tuple[float, float]:
            assert (await ta.completions.create(model="x", prompt="load x", max_tokens=2)).choices  # x takes the slot
            async with httpx.AsyncClient(timeout=30) as http:
                # Paused, the engine admits A's request (x in flight: its slot busy) and generates nothing; B's
                # request for y waits for the slot; the engine is let go and A's request ends. B's answer is a 503
                # at the 3 s slot wait without the release (x's mark is in its 10 s window): one_round raises.
                return await one_round(http, replica, (ta, "x", x), (tb, "y", b, y))

        to_load_s, to_answer_s = asyncio.run(scenario())
        print(f"B's load reached the engine {to_load_s * 1000:.0f} ms after A's request freed the slot there; "
              f"B answered {to_answer_s * 1000:.0f} ms after A")  # fmt: skip
        stats = sim_stats(replica)
        assert stats["cache_full_errors"] == {}  # the gateways never sent the engine a load it had no room for
        metrics = {url: httpx.get(url + "/metrics", headers=ADMIN).text for url in (a, b)}
        # B waited and A's word ended the wait: a release A published when its request ended, or (when B's wait
        # reached A after that) A's answer to the wait with nothing held there; which of the two depends on the
        # order the messages cross in, so the release counters are not asserted (one CI run saw the second).
        waited = '{outcome="waited",pool="trt",replica="t0"}'
        assert metric(metrics[b], "tenantgate_adapter_slot_waits_total", waited) >= 1
        assert metric(metrics[b], "tenantgate_adapter_slot_signal_up") == 1
        refused = '{outcome="refused",pool="trt",replica="t0"}'
        assert metric(metrics[b], "tenantgate_adapter_slot_waits_total", refused) == 0
