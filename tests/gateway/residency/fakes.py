"""A fake engine shared by the lifecycles (gateways) in a test, as one replica is shared by several gateways.

It counts loads and refuses none, so assertions are about what the gateway chose to do.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable

from backends.base import AdapterRef, Endpoint, EngineDriver, EngineLoad, EngineRequest


def ref(name: str) -> AdapterRef:
    return AdapterRef(name, f"/loras/{name}")


class FakeEngine:
    def __init__(self) -> None:
        self.loaded: dict[str, set[str]] = defaultdict(set)
        self.loads: Counter[tuple[str, str]] = Counter()
        self.unloads: list[tuple[str, str]] = []
        self.peak: dict[str, int] = defaultdict(int)
        self.duplicate_loads = 0  # a load of a name the replica already holds: a router loading twice
        self.warm_requests: list[tuple[str, bytes]] = []
        self.down: set[str] = set()


class FakeDriver:
    def __init__(self, engine: FakeEngine, load: EngineLoad | None = None) -> None:
        self.engine = engine
        self.load = load  # what load_signals reports for every replica (None: the engine reports nothing)
        self.prepared: list[str] = []
        # Hooks a test sets to hold a preparation or a load where it wants (awaited before the work is done).
        self.before_prepare: Callable[[AdapterRef], Awaitable[None]] | None = None
        self.before_load: Callable[[Endpoint, AdapterRef], Awaitable[None]] | None = None
        # What reading the answer to a one-token request for a model raises (an engine breaking off its answer).
        self.answer_errors: dict[str, Exception] = {}

    async def prepare_adapter(self, adapter: AdapterRef) -> None:
        if self.before_prepare is not None:
            await self.before_prepare(adapter)
        self.prepared.append(adapter.engine_name)

    async def load_adapter(self, replica: Endpoint, adapter: AdapterRef) -> None:
        if self.before_load is not None:
            await self.before_load(replica, adapter)
        await asyncio.sleep(0.01)  # a load takes time: concurrent callers overlap
        loaded = self.engine.loaded[replica.id]
        if adapter.engine_name in loaded:
            self.engine.duplicate_loads += 1
        else:
            self.engine.loads[(replica.id, adapter.engine_name)] += 1
            loaded.add(adapter.engine_name)
            self.engine.peak[replica.id] = max(self.engine.peak[replica.id], len(loaded))

    async def unload_adapter(self, replica: Endpoint, engine_name: str) -> None:
        self.engine.unloads.append((replica.id, engine_name))
        self.engine.loaded[replica.id].discard(engine_name)

    async def list_adapters(self, replica: Endpoint) -> set[str]:
        return set(self.engine.loaded[replica.id])

    async def send(self, replica: Endpoint, request: EngineRequest) -> FakeResponse:
        self.engine.warm_requests.append((replica.id, request.body))
        return FakeResponse(self.answer_errors.get(json.loads(request.body)["model"]))

    async def healthy(self, replica: Endpoint) -> bool:
        return replica.id not in self.engine.down

    async def load_signals(self, replica: Endpoint) -> EngineLoad | None:
        return self.load

    async def close(self) -> None:
        return None


class FakeResponse:
    status = 200
    content_type = "application/json"

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error

    async def read(self) -> bytes:
        if self.error is not None:
            raise self.error
        return b"{}"

    async def chunks(self) -> AsyncIterator[bytes]:
        yield b"{}"

    def release(self) -> None:
        return None


_: EngineDriver = FakeDriver(FakeEngine())  # mypy checks the fake against the driver interface, member by member
