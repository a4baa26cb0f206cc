"""How soon a slot one gateway frees ends another gateway's wait for it, end to end: two `tenantgate serve`
processes sharing a real redis-server, one simulated Triton replica whose PEFT cache holds one adapter (TensorRT-LLM
refuses a load into a full cache, so a gateway waits for the slot), the `openai` SDK as the client.

Each round one gateway's tenant holds the slot (its request admitted by the paused engine: in flight, generating
nothing), the other gateway's tenant asks for another adapter and waits for the slot, then the engine is let go:
the holder's request ends and frees the slot. The roles alternate. Measured per round, from the engine's own clock
(the simulator's PEFT cache notes, in wall-clock time, when a task's last request ended and when a task's weights
arrived; both processes share the host's clock):

- released -> load: the holder's request ends on the engine -> the waiter's load (its weights) reaches the engine:
  the holding gateway relays the end and publishes the release, the waiting gateway wakes, takes the replica's
  lock, evicts the holder's adapter from its record and sends its own;
- answered -> answered: the holder's client has its answer -> the waiter's client has its answer (the waiter's
  request through the engine included).

``--window`` sets the in-use window (``residency.use_flush_interval_s`` x 4): with the default 1 s a wait the
release did not end would show as about a second; at 10 s (the default here) it would give up (503) at the 3 s
slot wait.

    python -m loadtests.bench_slot_release_serve [--rounds 40] [--window 10]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai

from backends.lora_weights import task_id
from loadtests.bench_routing import redis_for
from loadtests.bench_slot_release import print_ms
from loadtests.fleet import (
    ADMIN_TOKEN,
    api_key,
    gateway_config,
    gateway_process,
    simulated_triton_replicas,
    triton_pool,
)
from loadtests.peft_files import write_peft_adapter
from loadtests.processes import free_port

MODEL, BASE = "tensorrt_llm_bls", "trt-base"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ONE_SLOT = ("--time-scale", "0.01", "--max-loras", "1", "--max-cpu-loras", "1")
WAITERS = 'tenantgate_adapter_slot_waiters{pool="trt",replica="t0"}'


@contextlib.contextmanager
def two_gateways_on_one_triton_slot(
    root: Path, redis_url: str, residency: dict[str, Any]
) -> Iterator[tuple[str, list[str], dict[str, str]]]:
    """Gateways A and B (tenant ta calls adapter x, tb calls y) over one Triton replica with one adapter slot;
    yields the replica's HTTP URL, the gateways' URLs and the adapters' sources."""
    adapters = {name: str(write_peft_adapter(root / name, 8, seed=i)) for i, name in enumerate(("x", "y"))}
    with simulated_triton_replicas(root, 1, MODEL, *ONE_SLOT) as replicas, contextlib.ExitStack() as stack:
        gateways = []
        for name in ("gw-a", "gw-b"):
            extra = {"state": {"redis_url": redis_url, "operation_timeout_s": 5}, "residency": residency}
            config: dict[str, Any] = gateway_config({}, {"ta": ["x"], "tb": ["y"]}, {}, port=free_port(), extra=extra)
            config["pools"] = [{**triton_pool(replicas, MODEL, BASE), "max_adapters": 1}]
            config["adapters"] = [{"name": n, "pool": "trt", "source": source} for n, source in adapters.items()]
            for tenant in config["tenants"]:
                tenant["base_models"] = [BASE]
            url, _ = stack.enter_context(gateway_process(root, config, name))
            gateways.append(url)
        yield replicas[0]["url"], gateways, adapters


def metric(text: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples with exactly these labels in a Prometheus text page."""
    found = re.findall(rf"^{name}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    return sum(float(value) for value in found)


async def until(read: Callable[[], Awaitable[Any]], check: Callable[[Any], bool], what: str) -> None:
    """Poll ``read`` until ``check`` holds: a bounded poll, about 30 s."""
    for _ in range(3_000):
        if check(await read()):
            return
        await asyncio.sleep(0.01)
    raise RuntimeError(f"never: {what}")


async def one_round(
    http: httpx.AsyncClient, replica: str, holder: tuple[openai.AsyncOpenAI, str, int],
    waiter: tuple[openai.AsyncOpenAI, str, str, int],
) -> tuple[float, float]:  # fmt: skip
    """The holder's adapter takes the slot and holds it; the waiter's waits on its gateway; the engine is let go.
    Returns (released -> the waiter's load at the engine, the holder's answer -> the waiter's answer), seconds."""
    hold_client, hold_model, hold_task = holder
    wait_client, wait_model, wait_gateway, wait_task = waiter

    async def stats() -> Any:
        return (await http.get(replica + "/sim/stats")).json()

    async def waiter_metrics() -> str:
        return (await http.get(wait_gateway + "/metrics", headers=ADMIN)).text

    await http.post(replica + "/sim/control", json={"paused": True})
    holding = asyncio.create_task(hold_client.completions.create(model=hold_model, prompt="hold it", max_tokens=2))
    await until(stats, lambda s: str(hold_task) in s["peft_cache"]["in_flight"], "the holder's request in flight")
    waiting = asyncio.create_task(wait_client.completions.create(model=wait_model, prompt="wait", max_tokens=2))
    await until(waiter_metrics, lambda text: metric(text, WAITERS) == 1, "the waiter waits for the slot")
    await http.post(replica + "/sim/control", json={"paused": False})
    assert (await holding).choices
    held_answer = time.time()
    assert (await waiting).choices[0].text
    waited_answer = time.time()
    cache = (await stats())["peft_cache"]
    return cache["weights_at"][str(wait_task)] - cache["released_at"][str(hold_task)], waited_answer - held_answer


async def measure(
    replica: str, gateways: list[str], adapters: dict[str, str], rounds: int
) -> list[tuple[float, float]]:
    a, b = gateways
    ta = openai.AsyncOpenAI(base_url=a + "/v1", api_key=api_key("ta"), max_retries=0, timeout=30)
    tb = openai.AsyncOpenAI(base_url=b + "/v1", api_key=api_key("tb"), max_retries=0, timeout=30)
    x, y = task_id("x", adapters["x"]), task_id("y", adapters["y"])
    figures = []
    async with httpx.AsyncClient(timeout=30) as http:
        assert (await ta.completions.create(model="x", prompt="load x", max_tokens=2)).choices  # x takes the slot
        for index in range(rounds):
            if index % 2 == 0:  # A holds x, B waits for y; then the other way round
                figures.append(await one_round(http, replica, (ta, "x", x), (tb, "y", b, y)))
            else:
                figures.append(await one_round(http, replica, (tb, "y", y), (ta, "x", a, x)))
    await ta.close()
    await tb.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--window", type=float, default=10.0, help="the in-use window, seconds (at least 1)")
    args = parser.parse_args()
    residency = {"use_flush_interval_s": args.window / 4, "slot_wait_timeout_s": 3.0, "fill_free_slots": False}
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        url = stack.enter_context(redis_for(root))
        replica, gateways, adapters = stack.enter_context(two_gateways_on_one_triton_slot(root, url, residency))
        figures = asyncio.run(measure(replica, gateways, adapters, args.rounds))
    print(f"{len(figures)} slots freed on one gateway while the other waited (in-use window {args.window:g} s), ms:")
    print_ms((("released -> load", [f[0] for f in figures]), ("answer -> answer", [f[1] for f in figures])), 18, 1)


if __name__ == "__main__":
    main()
