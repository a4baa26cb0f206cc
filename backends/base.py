"""The one interface every engine driver implements. A new engine is one new module that implements it and
registers itself (backends/registry.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple, Protocol


@dataclass(frozen=True)
class Endpoint:
    """One engine replica: its id and base URL. An engine that needs more (Triton: its gRPC address and metrics
    page) subclasses it, and its registered spec builds its replicas' endpoints (backends/registry.py)."""

    id: str
    url: str


# An engine's report about an adapter on a replica: (replica id, adapter engine name, event), e.g. Triton's
# "cache_miss" (the engine had dropped it) and "cache_full" (it could not take one more).
AdapterEvent = Callable[[str, str, str], None]


@dataclass(frozen=True)
class AdapterRef:
    """An adapter as the engine knows it: the name it serves it under and where it reads it from."""

    engine_name: str
    source: str


class EngineRequest(NamedTuple):
    """An OpenAI request ready for the engine: ``body`` already names the engine's model. Immutable; a named tuple
    because one is built per request (a frozen dataclass costs three times as much to build)."""

    path: str
    body: bytes
    stream: bool
    # Extra headers for the engine, e.g. W3C ``traceparent`` so its spans join the request's trace.
    headers: Mapping[str, str] = MappingProxyType({})
    # What is left of the request's deadline; None: the driver's own request timeout.
    timeout_s: float | None = None
    # The adapter the request runs through (None: the base model), for engines that take adapters per request.
    adapter: AdapterRef | None = None


@dataclass(frozen=True)
class EngineLoad:
    """The load signals an engine reports about itself (its own metrics), as last scraped."""

    running: float
    waiting: float
    kv_cache_usage: float
    # Adapters with requests running on the GPU now (vLLM's vllm:lora_requests_info; idle adapters in a GPU slot
    # are not listed). Empty for an engine that does not say.
    running_adapters: frozenset[str] = frozenset()
    # GPU adapter slots (vLLM's --max-loras, the max_lora label of that family); None where the engine does not say.
    gpu_slots: int | None = None
    # Tokens generated since the engine started (a counter); None where the engine reports none (Triton).
    generated_tokens: float | None = None


class EngineResponse(Protocol):
    """An engine's answer whose head has arrived (status 2xx); the body is read or streamed once."""

    status: int
    content_type: str

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as the engine sends it; raises ``StreamBroken`` if it ends abnormally."""
        ...

    def release(self) -> None:
        """Free the connection; if the body was not read to the end, the engine sees the request cancelled."""
        ...


class EngineDriver(Protocol):
    """Drives one pool's replicas of one engine kind.

    Contract (drivers keep no residency state; the gateway's residency lifecycle decides what to load, when):
    - ``prepare_adapter`` does what loading needs that no replica is involved in (reading and converting weights
      the gateway sends), so it runs before the replica's load lock is taken; raises ``AdapterLoadFailed``.
    - ``load_adapter`` returns once the adapter is loaded on the replica (also when it already was). Raises
      ``AdapterLoadFailed``, ``EngineUnavailable`` or ``EngineTimeout``.
    - ``unload_adapter`` returns once the engine has forgotten the adapter (also when it did not know it).
    - ``list_adapters`` returns the engine names of the adapters the replica reports loaded, or None when the
      engine does not report them (TensorRT-LLM); raises ``EngineUnavailable`` or ``EngineTimeout``.
    - ``send`` returns once the engine's answer head has arrived with a 2xx status; before that it raises
      ``EngineUnavailable``, ``EngineTimeout``, ``AdapterNotLoaded`` (load it again) or ``EngineRejected``.
      Nothing has reached the client when it raises, so the caller may try again elsewhere.
    - ``healthy`` probes the replica's health endpoint; it never raises.
    - ``load_signals`` reads the engine's own load metrics; None when it cannot (it never raises).
    """

    async def prepare_adapter(self, adapter: AdapterRef) -> None: ...

    async def load_adapter(self, replica: Endpoint, adapter: AdapterRef) -> None: ...

    async def unload_adapter(self, replica: Endpoint, engine_name: str) -> None: ...

    async def list_adapters(self, replica: Endpoint) -> set[str] | None: ...

    async def send(self, replica: Endpoint, request: EngineRequest) -> EngineResponse: ...

    async def healthy(self, replica: Endpoint) -> bool: ...

    async def load_signals(self, replica: Endpoint) -> EngineLoad | None: ...

    async def close(self) -> None: ...
