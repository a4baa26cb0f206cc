"""Where an engine keeps LoRA adapters, in vLLM's three layers.

1. Registered names: unbounded; what ``/v1/models`` lists. Loading reads the adapter from disk at once.
2. Host memory: an LRU of ``max_cpu_loras`` adapters. A request whose adapter fell out is read from disk again.
3. GPU slots: an LRU of ``max_loras`` adapters. A request gets a slot only if its adapter holds one or one can be
   freed from an adapter that no running request uses; otherwise it waits, as vLLM's scheduler skips it.

Unregistering only forgets the name, as vLLM's unload does: the caches still hold the adapter until evicted.
Each method returns the simulated seconds its work costs; the engine adds them to the step that needs them.
"""

from __future__ import annotations

import json
import random
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from loadtests.sim.defaults import SimParams
from loadtests.sim.stats import SimStats


class AdapterError(Exception):
    """A load or unload that vLLM refuses; ``status`` is the HTTP status vLLM answers with."""

    def __init__(self, message: str, status: int, error_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    rank: int


def read_adapter(name: str, path: str, max_rank: int) -> AdapterInfo:
    """Read a PEFT adapter directory the way vLLM validates it on load."""
    config_file = Path(path) / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"Loading lora {name} failed: No adapter found for {path}", 404, "NotFoundError") from exc
    rank = int(config.get("r", 8))
    if rank > max_rank:
        raise AdapterError(  # vLLM's worker raises, and its API server answers 500 but stays up
            f"Call to add_lora method failed: Worker failed with error 'LoRA rank {rank} is greater than "
            f"max_lora_rank {max_rank}.', please check the stack trace above for the root cause",
            500,
            "InternalServerError",
        )
    return AdapterInfo(name=name, path=path, rank=rank)


class AdapterCaches:
    def __init__(self, params: SimParams, stats: SimStats, rng: random.Random) -> None:
        self._params = params
        self._stats = stats
        self._rng = rng
        self.registered: dict[str, AdapterInfo] = {}
        self._host: OrderedDict[str, AdapterInfo] = OrderedDict()
        self._gpu: OrderedDict[str, None] = OrderedDict()
        self.running = Counter[str]()

    # --- layer 1: names -----------------------------------------------------------------------------------
    def check_unregistered(self, name: str) -> None:
        if name in self.registered:
            raise AdapterError(
                f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                "place, set 'load_inplace' to True.",
                400,
                "InvalidUserInput",
            )

    def register(self, info: AdapterInfo) -> float:
        self.check_unregistered(info.name)
        self.registered[info.name] = info
        return self._into_host(info, cause="load")

    def unregister(self, name: str) -> None:
        if self.registered.pop(name, None) is None:
            raise AdapterError(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")

    # --- TensorRT-LLM's PEFT cache (loadtests/sim/peft_cache.py) drives these instead of the three above -----
    def remember(self, info: AdapterInfo) -> None:
        """Know an adapter whose weights came with a request: its load into host memory and a GPU slot is paid
        when a request for it is first scheduled (``activate``), not here."""
        self.registered[info.name] = info

    def forget(self, name: str) -> None:
        """Drop an adapter from every layer: its weights are gone, and nothing can read them again."""
        self.registered.pop(name, None)
        self._host.pop(name, None)
        self._gpu.pop(name, None)

    # --- layers 2 and 3: caches ---------------------------------------------------------------------------
    def can_activate(self, name: str) -> bool:
        return name in self._gpu or len(self._gpu) < self._params.max_loras or self._idle_gpu_adapter() is not None

    def activate(self, name: str, info: AdapterInfo | None = None) -> float:
        """Give ``name`` a GPU slot for a request that is being admitted; ``can_activate`` must be true. ``info``:
        the adapter as the request got it, used when its name has been unloaded since (vLLM serves such a request
        from the path its LoRARequest carries)."""
        self.running[name] += 1
        if name in self._gpu:
            self._gpu.move_to_end(name)
            self._host.move_to_end(name)
            return 0.0
        cost = 0.0
        known = self.registered.get(name, info)
        assert known is not None, f"no adapter {name!r} for a request admitted with it"
        info = known
        if name in self._host:
            self._host.move_to_end(name)
        else:
            cost += self._into_host(info, cause="request")
        if len(self._gpu) >= self._params.max_loras:
            victim = self._idle_gpu_adapter()
            assert victim is not None, "activate() called without can_activate()"
            del self._gpu[victim]
            self._stats.gpu_evictions += 1
        self._gpu[name] = None
        self._stats.swap_ins += 1
        return cost + self._params.swap_in_s

    def deactivate(self, name: str) -> None:
        self.running[name] -= 1
        if self.running[name] <= 0:
            del self.running[name]

    @property
    def gpu_resident(self) -> list[str]:
        return list(self._gpu)

    @property
    def host_resident(self) -> list[str]:
        return list(self._host)

    def _idle_gpu_adapter(self) -> str | None:
        return next((name for name in self._gpu if not self.running[name]), None)

    def _into_host(self, info: AdapterInfo, cause: str) -> float:
        if info.name in self._host:
            self._host.move_to_end(info.name)
            return 0.0
        evicted: list[str] = []
        while len(self._host) >= self._params.max_cpu_loras:
            victim = next((name for name in self._host if not self.running[name]), None)
            if victim is None:
                break
            del self._host[victim]
            self._gpu.pop(victim, None)
            self._stats.host_evictions += 1
            evicted.append(victim)
        self._host[info.name] = info
        self._stats.record_cold_load(info.name, cause, tuple(evicted))
        p = self._params
        jitter = 1.0 + p.cold_load_jitter * self._rng.uniform(-1.0, 1.0)
        return p.cold_load_s * (0.5 + 0.5 * info.rank / p.cold_load_reference_rank) * jitter
