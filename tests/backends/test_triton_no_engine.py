"""What the Triton driver decides before any engine is involved, so no engine lane can test it:

- TensorRT-LLM takes an adapter's weights in the request (docs/triton.md), so the gateway reads the adapter's
  directory itself: a missing one fails in the driver, and no engine ever sees a path.
- An unreachable replica has no engine to answer: the driver maps gRPC's UNAVAILABLE, and its metrics scrape
  finds nothing.
"""

from __future__ import annotations

import json

import pytest

from backends.base import AdapterRef, EngineRequest
from backends.errors import AdapterLoadFailed, EngineUnavailable
from backends.triton import TritonDriver
from backends.triton_config import TritonEndpoint
from loadtests.processes import free_port


def _gone() -> TritonEndpoint:
    port = free_port()
    return TritonEndpoint("gone", f"http://127.0.0.1:{port}", f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/metrics")


def _driver() -> TritonDriver:
    return TritonDriver(
        model="tensorrt_llm_bls", lora_dtype="float16", default_max_tokens=8, chat_template=None,
        request_timeout_s=10, adapter_load_timeout_s=10, probe_timeout_s=2,
    )  # fmt: skip


async def test_a_missing_adapter_directory_fails_to_load_with_its_path() -> None:
    driver = _driver()
    try:
        with pytest.raises(AdapterLoadFailed, match=r"no adapter_config\.json") as caught:
            await driver.load_adapter(_gone(), AdapterRef("nowhere", "/nonexistent/adapter"))
        assert caught.value.status == 400
    finally:
        await driver.close()


async def test_an_unreachable_replica_is_unavailable() -> None:
    driver = _driver()
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2}).encode()
    try:
        with pytest.raises(EngineUnavailable, match="gone unreachable"):
            await driver.send(_gone(), EngineRequest("/v1/completions", body, False))
        assert await driver.load_signals(_gone()) is None
        assert not await driver.healthy(_gone())
    finally:
        await driver.close()
