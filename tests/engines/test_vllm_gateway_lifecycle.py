"""The adapter lifecycle against a real vLLM (CPU) server: the gateway loads, uses, evicts and unloads real LoRA
adapters through vLLM's API, and greedy outputs through the gateway equal vLLM's own for the same adapter.

It shares the session's vLLM server with the conformance lane and leaves it with the adapters it found.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from loadtests.fleet import ADMIN_TOKEN, api_key, gateway_config, gateway_process
from loadtests.processes import free_port
from tests.servers import EngineProcess

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def greedy(client: openai.OpenAI, model: str) -> str:
    answer = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=8, temperature=0.0)
    return answer.choices[0].text


def registered(engine: EngineProcess) -> set[str]:
    models = httpx.get(engine.url + "/v1/models", timeout=30).json()["data"]
    return {m["id"] for m in models if m.get("parent")}


@pytest.fixture
def engine_as_found(vllm_engine: EngineProcess) -> Iterator[EngineProcess]:
    """Put back the adapters the test found loaded, and unload the ones it added."""
    before = registered(vllm_engine)
    yield vllm_engine
    after = registered(vllm_engine)
    for name in after - before:
        httpx.post(vllm_engine.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
    for name in before - after:
        body = {"lora_name": name, "lora_path": vllm_engine.adapters[name]}
        httpx.post(vllm_engine.url + "/v1/load_lora_adapter", json=body, timeout=60)


def test_load_use_evict_and_unload_real_adapters(engine_as_found: EngineProcess, tmp_path: Path) -> None:
    engine = engine_as_found
    found = registered(engine) - {"a3", "a4"}
    adapters = {name: engine.adapters[name] for name in ("a3", "a4")}
    # The working set is what the engine holds now plus one: a3 fits, a4 must evict the least recently used.
    config = gateway_config(
        {"r0": engine.url}, {"acme": ["a3", "a4"]}, adapters, port=free_port(), max_adapters=len(found) + 1
    )
    with gateway_process(tmp_path, config) as (gateway_url, _):
        client = openai.OpenAI(base_url=gateway_url + "/v1", api_key=api_key("acme"), max_retries=0, timeout=120)
        direct = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        through_gateway = greedy(client, "a3")
        assert "a3" in registered(engine)
        from_vllm = greedy(direct, "a3")
        assert through_gateway == from_vllm and through_gateway

        greedy(client, "a4")
        now = registered(engine)
        assert "a4" in now and "a3" in now  # a3 was used last: one of the adapters found there made room
        assert len(now) == len(found) + 1 and len(found - now) == 1

        answer = httpx.delete(gateway_url + "/admin/adapters/a3/residency", headers=ADMIN, timeout=60)
        assert answer.status_code == 200 and answer.json()["unloaded_from"] == ["r0"]
        assert "a3" not in registered(engine)

        again = greedy(client, "a3")
        assert again == from_vllm  # loaded again on demand, same greedy answer
