"""``echo``: an engine only the tests ship, to show that an engine is one module that registers itself
(backends/registry.py) and reaches a gateway started as a process through the config's ``engines:`` list.

Its replicas are vLLM replicas (the simulator), driven by backends.vllm's driver by composition. What is its own:

- the pool section ``echo: {reply_prefix, fingerprint}``: every whole (non-streaming) answer's text starts with
  ``reply_prefix`` and its ``system_fingerprint`` is ``fingerprint:<replica tag>``;
- a replica key, ``tag``, which its endpoint type (``EchoEndpoint``) carries to the driver;
- a config check: an echo pool's adapter sources must be absolute paths.

Streams pass through unchanged.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from backends.base import AdapterRef, Endpoint, EngineLoad, EngineRequest, EngineResponse
from backends.registry import ConfiguredReplica, EngineSpec, PoolSettings, register
from backends.vllm import VllmDriver


class EchoSettings(BaseModel):
    """The pool's ``echo:`` section."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    reply_prefix: str = "[echo] "
    fingerprint: str = Field(default="echo", min_length=1, max_length=64)


class EchoReplica(BaseModel):
    """An echo replica's own key."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tag: str = Field(default="untagged", min_length=1, max_length=64)


@dataclass(frozen=True)
class EchoEndpoint(Endpoint):
    tag: str


class EchoResponse:
    """The vLLM replica's answer, marked: the prefix before each choice's text, the fingerprint with its tag."""

    def __init__(self, inner: EngineResponse, prefix: str, fingerprint: str) -> None:
        self._inner, self._prefix, self._fingerprint = inner, prefix, fingerprint
        self.status = inner.status
        self.content_type = inner.content_type

    async def read(self) -> bytes:
        answer: dict[str, Any] = json.loads(await self._inner.read())
        for choice in answer.get("choices", []):
            message = choice.get("message")
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                message["content"] = self._prefix + message["content"]
            elif isinstance(choice.get("text"), str):
                choice["text"] = self._prefix + choice["text"]
        answer["system_fingerprint"] = self._fingerprint
        return json.dumps(answer).encode()

    def chunks(self) -> AsyncIterator[bytes]:
        return self._inner.chunks()

    def release(self) -> None:
        self._inner.release()


class EchoDriver:
    """backends.vllm's driver for everything; answers marked on the way back."""

    def __init__(self, settings: EchoSettings, pool: PoolSettings) -> None:
        self._settings = settings
        self._vllm = VllmDriver(
            connect_timeout_s=pool.connect_timeout_s,
            request_timeout_s=pool.request_timeout_s,
            adapter_load_timeout_s=pool.adapter_load_timeout_s,
            max_connections_per_replica=pool.max_connections_per_replica,
            probe_timeout_s=pool.probe_timeout_s,
        )

    async def prepare_adapter(self, adapter: AdapterRef) -> None:
        await self._vllm.prepare_adapter(adapter)

    async def load_adapter(self, replica: Endpoint, adapter: AdapterRef) -> None:
        await self._vllm.load_adapter(replica, adapter)

    async def unload_adapter(self, replica: Endpoint, engine_name: str) -> None:
        await self._vllm.unload_adapter(replica, engine_name)

    async def list_adapters(self, replica: Endpoint) -> set[str] | None:
        return await self._vllm.list_adapters(replica)

    async def send(self, replica: Endpoint, request: EngineRequest) -> EchoResponse:
        response = await self._vllm.send(replica, request)
        tag = replica.tag if isinstance(replica, EchoEndpoint) else "untagged"
        return EchoResponse(response, self._settings.reply_prefix, f"{self._settings.fingerprint}:{tag}")

    async def healthy(self, replica: Endpoint) -> bool:
        return await self._vllm.healthy(replica)

    async def load_signals(self, replica: Endpoint) -> EngineLoad | None:
        return await self._vllm.load_signals(replica)

    async def close(self) -> None:
        await self._vllm.close()


def echo_endpoint(replica: ConfiguredReplica, settings: EchoSettings) -> EchoEndpoint:
    extras = replica.extras if isinstance(replica.extras, EchoReplica) else EchoReplica()
    return EchoEndpoint(replica.id, replica.url, extras.tag)


def absolute_sources(pool: str, settings: EchoSettings, adapters: Mapping[str, AdapterRef]) -> list[str]:
    return [
        f"adapter {name!r} of echo pool {pool!r}: source {adapter.source!r} is not an absolute path"
        for name, adapter in adapters.items()
        if not adapter.source.startswith("/")
    ]


SPEC = register(
    EngineSpec(
        name="echo",
        settings=EchoSettings,
        driver=EchoDriver,
        replica=EchoReplica,
        endpoint=echo_endpoint,
        checks=absolute_sources,
    )
)
