"""A mixed fleet end to end through the `openai` SDK: one vLLM pool and one Triton pool (both simulated, each in
its own engine protocol), tenants of both, the same answer shapes, and the Triton path's LoRA weights discipline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest
import yaml
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionStreamOptionsParam

from backends.base import AdapterRef, Endpoint, EngineRequest
from backends.lora_weights import task_id
from backends.triton import TritonDriver
from backends.triton_config import TritonEndpoint
from loadtests.fleet import (
    ADMIN_TOKEN,
    BASE_MODEL,
    api_key,
    gateway_config,
    gateway_process,
    sim_stats,
    simulated_triton_replicas,
    triton_pool,
)
from loadtests.peft_files import write_peft_adapter
from loadtests.processes import free_port, running, sim_command
from tests.shapes import shape

pytestmark = pytest.mark.timeout(180)
TRITON_BASE = "trt-base"
MODEL = "tensorrt_llm_bls"
FAST = ("--time-scale", "0.01", "--max-loras", "2", "--max-cpu-loras", "2")
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class TritonSim:
    id: str
    http_url: str
    grpc_address: str

    def endpoint(self) -> Endpoint:
        return TritonEndpoint(self.id, self.http_url, self.grpc_address, self.http_url + "/metrics")


@contextlib.contextmanager
def triton_sims(root: Path, count: int) -> Iterator[tuple[list[TritonSim], dict[str, Any]]]:
    """The simulated Triton replicas and a Triton pool's config over them."""
    with simulated_triton_replicas(root, count, MODEL, *FAST) as replicas:
        sims = [TritonSim(r["id"], r["url"], r["grpc"]) for r in replicas]
        yield sims, triton_pool(replicas, MODEL, TRITON_BASE)


@contextlib.contextmanager
def vllm_sim(root: Path) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running(sim_command(port, "--model", BASE_MODEL, *FAST), url, root / "vllm.log", start_timeout_s=30):
        yield url


@dataclass
class MixedFleet:
    url: str
    sims: list[TritonSim]
    adapters: dict[str, str]

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key(tenant), max_retries=0, timeout=60)

    def home(self, tenant: str) -> TritonSim:
        answer = httpx.get(
            self.url + f"/admin/route?tenant={tenant}", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ).json()
        return next(sim for sim in self.sims if sim.id == answer["home"])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MixedFleet]:
    root = tmp_path_factory.mktemp("mixed")
    adapters = {name: str(write_peft_adapter(root / name, 8, seed=i)) for i, name in enumerate(("v-a", "t-a", "t-b"))}
    with vllm_sim(root) as vllm_url, triton_sims(root, 2) as (sims, pool):
        tenants = {"vt": ["v-a"], "tt": ["t-a"], "tt2": ["t-b"]}
        config = gateway_config({"v0": vllm_url}, tenants, {"v-a": adapters["v-a"]}, port=free_port())
        config["pools"].append(pool)
        config["adapters"] += [{"name": name, "pool": "trt", "source": adapters[name]} for name in ("t-a", "t-b")]
        for tenant in config["tenants"]:
            tenant["base_models"] = [BASE_MODEL if tenant["id"] == "vt" else TRITON_BASE]
        with gateway_process(root, config) as (url, _):
            yield MixedFleet(url, sims, adapters)


def _streamed(stream: Iterable[pydantic.BaseModel]) -> list[dict[str, Any]]:
    return [chunk.model_dump() for chunk in stream]


@pytest.mark.parametrize("model_of", [{"vt": "v-a", "tt": "t-a"}, {"vt": BASE_MODEL, "tt": TRITON_BASE}],
                         ids=["adapter", "base"])  # fmt: skip
def test_tenants_of_both_engines_get_the_same_answer_shapes(fleet: MixedFleet, model_of: dict[str, str]) -> None:
    shapes: dict[str, list[object]] = {}
    for tenant, model in model_of.items():
        client = fleet.client(tenant)
        chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
        completion = client.completions.create(model=model, prompt="hello world", max_tokens=4).model_dump()
        answer = client.chat.completions.create(model=model, messages=chat, max_tokens=4).model_dump()
        usage: ChatCompletionStreamOptionsParam = {"include_usage": True}
        chunks = _streamed(client.completions.create(model=model, prompt="hi", max_tokens=4, stream=True,
                                                     stream_options=usage))  # fmt: skip
        chat_chunks = _streamed(client.chat.completions.create(model=model, messages=chat, max_tokens=4, stream=True,
                                                               stream_options=usage))  # fmt: skip
        assert completion["model"] == model and completion["usage"]["completion_tokens"] >= 1
        assert chunks[-1]["usage"]["completion_tokens"] >= 1 and chunks[-1]["choices"] == []
        assert chat_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"]["content"] or "" for c in chat_chunks if c["choices"])
        assert text, tenant
        shapes[tenant] = [
            shape(completion), shape(answer), [shape(c) for c in chunks[-2:]], [shape(c) for c in chat_chunks[-2:]]
        ]  # fmt: skip
    assert shapes["vt"] == shapes["tt"]


def test_triton_weights_go_once_per_replica_and_task(fleet: MixedFleet) -> None:
    home = fleet.home("tt2")
    others = [sim for sim in fleet.sims if sim is not home]
    client = fleet.client("tt2")
    for index in range(6):
        prompt = f"request {index}"
        if index % 2 == 1:
            assert _streamed(client.completions.create(model="t-b", prompt=prompt, max_tokens=3, stream=True))
        else:
            assert client.completions.create(model="t-b", prompt=prompt, max_tokens=3).choices
    task = str(task_id("t-b", fleet.adapters["t-b"]))
    stats = sim_stats(home.http_url)
    assert stats["weights_received"].get(task) == 1
    assert stats["cache_misses"].get(task, 0) == 0
    assert all(sim_stats(sim.http_url)["weights_received"].get(task, 0) == 0 for sim in others)


def test_streaming_requests_go_over_http_and_the_others_over_grpc(fleet: MixedFleet) -> None:
    """Streaming requests take Triton's generate extension (a third of gRPC's CPU in the gateway); non-streaming
    ones stay on gRPC, which cancels them at once when their client leaves (docs/triton.md)."""
    home = fleet.home("tt2")
    client = fleet.client("tt2")
    assert client.completions.create(model="t-b", prompt="warm", max_tokens=2).choices  # loaded here
    before = sim_stats(home.http_url)["requests_by_protocol"]
    chat: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello there"}]
    assert _streamed(client.completions.create(model="t-b", prompt="one", max_tokens=3, stream=True))
    assert _streamed(client.chat.completions.create(model="t-b", messages=chat, max_tokens=3, stream=True))
    assert client.completions.create(model="t-b", prompt="two", max_tokens=3).choices[0].text
    after = sim_stats(home.http_url)["requests_by_protocol"]
    assert after["http"] == before.get("http", 0) + 2 and after["grpc"] == before["grpc"] + 1


async def test_a_forced_eviction_costs_one_resend_with_the_weights(fleet: MixedFleet) -> None:
    client = fleet.client("tt")
    assert client.completions.create(model="t-a", prompt="warm", max_tokens=2).choices
    home = fleet.home("tt")
    task = str(task_id("t-a", fleet.adapters["t-a"]))
    before = sim_stats(home.http_url)
    # Another client fills the engine's two-adapter PEFT cache: t-a is evicted behind the gateway's back.
    intruder = TritonDriver(
        model=MODEL, lora_dtype="float16", default_max_tokens=4, chat_template=None, request_timeout_s=30,
        adapter_load_timeout_s=30, probe_timeout_s=5,
    )  # fmt: skip
    try:
        for name in ("intruder-1", "intruder-2"):
            await intruder.load_adapter(home.endpoint(), AdapterRef(name, fleet.adapters["v-a"]))
    finally:
        await intruder.close()
    assert client.completions.create(model="t-a", prompt="after eviction", max_tokens=2).choices[0].text
    after = sim_stats(home.http_url)
    assert after["cache_misses"].get(task, 0) == before["cache_misses"].get(task, 0) + 1
    assert after["weights_received"][task] == before["weights_received"][task] + 1
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(fleet.url + "/metrics", headers=ADMIN)).text
    pattern = rf'tenantgate_engine_adapter_events_total{{event="cache_miss",pool="trt",replica="{home.id}"}} (\S+)'
    assert [float(v) for v in re.findall(pattern, metrics)] == [1.0]


def test_changing_a_pools_backend_and_reloading_moves_its_traffic(tmp_path: Path) -> None:
    adapter = str(write_peft_adapter(tmp_path / "x", 8))
    with vllm_sim(tmp_path) as vllm_url, triton_sims(tmp_path, 1) as (sims, pool):
        config = gateway_config({"r0": vllm_url}, {"acme": ["x"]}, {"x": adapter}, port=free_port())
        with gateway_process(tmp_path, config) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key=api_key("acme"), max_retries=0, timeout=60)
            assert client.completions.create(model="x", prompt="on vllm", max_tokens=2).choices
            assert sim_stats(vllm_url)["requests"] >= 1
            # The same pool, tenants and adapter names, now on Triton replicas.
            config["pools"] = [{**pool, "name": "llama", "base_model": BASE_MODEL}]
            (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            reload = httpx.post(url + "/admin/reload", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=60)
            assert reload.status_code == 200, reload.text
            served_by_vllm = sim_stats(vllm_url)["requests"]
            for model in ("x", BASE_MODEL):
                assert client.completions.create(model=model, prompt="on triton", max_tokens=2).choices[0].text
            assert sim_stats(vllm_url)["requests"] == served_by_vllm
            triton = sim_stats(sims[0].http_url)
            assert triton["weights_received"] == {str(task_id("x", adapter)): 1}
            assert triton["requests"] >= 2


async def test_a_client_leaving_mid_stream_cancels_the_engines_request(fleet: MixedFleet) -> None:
    home = fleet.home("tt2")
    body = {"model": "t-b", "prompt": "a long answer", "max_tokens": 400, "stream": True}
    headers = {"Authorization": f"Bearer {api_key('tt2')}"}
    async with httpx.AsyncClient(timeout=30) as http:

        async def aborted() -> int:
            count: int = (await http.get(home.http_url + "/sim/stats")).json()["aborted"]
            return count

        before = await aborted()
        assert fleet.client("tt2").completions.create(model="t-b", prompt="warm", max_tokens=2).choices  # loaded
        # The engine makes one token and then holds: the stream is open, mid-answer, however slow the machine is.
        await http.post(home.http_url + "/sim/control", json={"run_steps": 1})
        try:
            async with http.stream("POST", fleet.url + "/v1/completions", json=body, headers=headers) as response:
                assert response.status_code == 200
                async for _ in response.aiter_bytes():
                    break
            for _ in range(200):  # bounded: the gateway cancels the gRPC call as the client's connection closes
                if await aborted() == before + 1:
                    break
                await asyncio.sleep(0.05)
            assert await aborted() == before + 1
        finally:
            await http.post(home.http_url + "/sim/control", json={"paused": False})


async def _until_in_flight(http: httpx.AsyncClient, sim: TritonSim, tasks: set[str]) -> None:
    """Wait until the engine holds every one of these LoRA tasks in flight."""
    for _ in range(3000):  # bounded: about 30 s
        if tasks <= set((await http.get(sim.http_url + "/sim/stats")).json()["peft_cache"]["in_flight"]):
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"the engine never held {sorted(tasks)} in flight")


async def test_a_full_engine_cache_is_retried_elsewhere_and_leaves_the_record(fleet: MixedFleet) -> None:
    """Another client holds both of the home engine's PEFT slots with requests in flight: the tenant's adapter,
    evicted meanwhile, cannot go back in. The gateway answers from another replica, counts the event, and stops
    believing the adapter resident at home; the home replica's health is untouched."""
    client = fleet.client("tt")
    assert client.completions.create(model="t-a", prompt="warm", max_tokens=2).choices
    home = fleet.home("tt")
    task = str(task_id("t-a", fleet.adapters["t-a"]))
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    intruder = TritonDriver(
        model=MODEL, lora_dtype="float16", default_max_tokens=4, chat_template=None, request_timeout_s=30,
        adapter_load_timeout_s=30, probe_timeout_s=5,
    )  # fmt: skip
    holders = [AdapterRef(name, fleet.adapters["v-a"]) for name in ("holder-1", "holder-2")]
    holding: list[asyncio.Task[Any]] = []
    async with httpx.AsyncClient(timeout=30) as http:
        try:
            for adapter in holders:  # evicts t-a from the engine's two PEFT slots
                await intruder.load_adapter(home.endpoint(), adapter)
            # Paused, the engine admits requests (their tasks go in flight) but generates nothing: the holders
            # keep both slots busy however slow the machine is.
            await http.post(home.http_url + "/sim/control", json={"paused": True})
            for adapter in holders:
                body = json.dumps({"model": adapter.engine_name, "prompt": "hold", "max_tokens": 4}).encode()
                request = EngineRequest("/v1/completions", body, True, adapter=adapter)
                holding.append(asyncio.create_task(intruder.send(home.endpoint(), request)))
            holder_tasks = {str(task_id(a.engine_name, a.source)) for a in holders}
            await _until_in_flight(http, home, holder_tasks)
            answer = await asyncio.to_thread(client.completions.create, model="t-a", prompt="now", max_tokens=2)
            assert answer.choices[0].text
            stats = (await http.get(home.http_url + "/sim/stats")).json()
            assert stats["cache_full_errors"].get(task) == 1
            residency = (await http.get(fleet.url + "/admin/residency", headers=admin)).json()
            replica = residency["pools"]["trt"]["replicas"][home.id]
            assert "t-a" not in replica["adapters"] and replica["healthy"]
            metrics = (await http.get(fleet.url + "/metrics", headers=ADMIN)).text
            pattern = (
                rf'tenantgate_engine_adapter_events_total{{event="cache_full",pool="trt",replica="{home.id}"}} (\S+)'
            )
            assert [float(v) for v in re.findall(pattern, metrics)] == [1.0]
        finally:
            await http.post(home.http_url + "/sim/control", json={"paused": False})
            for response in await asyncio.gather(*holding, return_exceptions=True):
                if not isinstance(response, BaseException):
                    response.release()
            await intruder.close()
