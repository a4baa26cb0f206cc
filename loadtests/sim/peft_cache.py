"""TensorRT-LLM's PEFT cache as the simulated Triton model keeps it: LoRA weights arrive with requests, keyed by
``lora_task_id`` (TensorRT-LLM ``peftCacheManager.cpp``, ``loraCache.cpp``, ``loraUtils.cpp``; the error texts
are theirs, docs/triton.md says what the gateway relies on).

- A request with ``lora_weights`` and ``lora_config`` puts its task in the cache; later requests send the id only.
- The cache holds ``capacity`` tasks (``--max-cpu-loras``). A new task evicts the least recently used task with no
  request in flight; when every cached task has one, the request fails "Cache is full".
- Evicted means forgotten: an id-only request for it fails "not found in cache" until the weights are sent again.
  TensorRT-LLM never reads adapters itself, unlike vLLM, whose host LRU re-reads an evicted adapter from disk.

The engine's adapter caches (loadtests/sim/adapters.py) still model the GPU slots and the cost of the first load;
this cache decides which adapters they know.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadtests.sim.adapters import AdapterCaches, AdapterInfo

# TensorRT-LLM's LoRA module ids 0..21 (cpp/include/tensorrt_llm/runtime/loraModule.h); every one is enabled.
MODULES = (
    "attn_qkv", "attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate",
    "cross_attn_qkv", "cross_attn_q", "cross_attn_k", "cross_attn_v", "cross_attn_dense",
    "moe_h_to_4h", "moe_4h_to_h", "moe_gate", "moe_router", "mlp_router", "mlp_gate_up",
    "shared_expert_h_to_4h", "shared_expert_4h_to_h", "shared_expert_gate",
)  # fmt: skip
_CONFIG_COLUMNS = 3  # module id, layer, adapter size (rank); the DoRA column is refused by the model's dims

Tensor = np.ndarray[Any, Any]


class PeftError(Exception):
    """A request the PEFT cache refuses; the message is TensorRT-LLM's."""


@dataclass(frozen=True)
class LoraTask:
    task_id: int
    rank: int  # the largest adapter size in its config: what its load costs
    digest: str  # of its weights and config: the answer text depends on it, so tests can tell adapters apart

    @property
    def adapter(self) -> str:
        """Its name in the engine's adapter caches and stats."""
        return f"task-{self.task_id}"


@dataclass
class PeftStats:
    """Per task id: requests that carried valid weights, id-only requests that missed, requests refused because
    the cache was full, and times the task was evicted."""

    weights_received: Counter[int] = field(default_factory=Counter)
    cache_misses: Counter[int] = field(default_factory=Counter)
    cache_full_errors: Counter[int] = field(default_factory=Counter)
    evictions: Counter[int] = field(default_factory=Counter)

    def as_json(self) -> dict[str, dict[str, int]]:
        counters = {
            "weights_received": self.weights_received,
            "cache_misses": self.cache_misses,
            "cache_full_errors": self.cache_full_errors,
            "evictions": self.evictions,
        }
        return {name: {str(task): n for task, n in counter.items()} for name, counter in counters.items()}


def read_task(task_id: int, weights: Tensor | None, config: Tensor | None, max_rank: int) -> LoraTask:
    """Validate a request's LoRA tensors as TensorRT-LLM's loraValidateRequestTensors does."""
    if weights is None or config is None:
        raise PeftError("Request for LoRA inference must have both lora_weights and lora_keys")
    if weights.ndim != 3:
        raise PeftError("Invalid shape for lora_weights tensor")
    if config.ndim != 3:
        raise PeftError("Invalid shape for lora_keys tensor")
    if weights.shape[0] != 1 or config.shape[0] != 1:
        raise PeftError("Expected batch dimension to be 1 for each lora request")
    if config.shape[1] != weights.shape[1]:
        raise PeftError("Expected dim1 lora_weights and lora_keys to have the same size")
    if config.shape[2] != _CONFIG_COLUMNS:
        raise PeftError(f"Expected dim2 of lora_keys to have a size of {_CONFIG_COLUMNS}")
    if config.shape[1] == 0:
        raise PeftError("Expected lora_config to have at least one row")
    for module, layer, rank in config[0].tolist():
        if layer < 0:
            raise PeftError("Expected layerId to be in the range [0, numModelLayers)")
        if not 0 <= module < len(MODULES):
            raise PeftError(f"lora module {module} not enabled for this model")
        if not 0 < rank <= max_rank:
            raise PeftError(
                f"Invalid low_rank ({rank}). low_rank must be greater than 0 and less than max_low_rank ({max_rank})"
            )
    digest = hashlib.sha256(weights.tobytes() + config.tobytes()).hexdigest()[:16]
    return LoraTask(task_id=task_id, rank=int(config[0, :, 2].max()), digest=digest)


class PeftCache:
    def __init__(self, capacity: int, max_rank: int, adapters: AdapterCaches) -> None:
        self.capacity = capacity
        self._max_rank = max_rank
        self._adapters = adapters
        self._tasks: OrderedDict[int, LoraTask] = OrderedDict()  # least recently used first
        self._in_flight = Counter[int]()
        self.stats = PeftStats()
        # Per task, when (wall clock: comparable across processes on one host) its weights last arrived and its
        # last request in flight ended: how soon a router sends a waiting adapter after a slot frees, as the engine
        # sees it (loadtests/bench_slot_release_serve.py).
        self.weights_at: dict[int, float] = {}
        self.released_at: dict[int, float] = {}

    def acquire(self, task_id: int | None, weights: Tensor | None, config: Tensor | None) -> LoraTask | None:
        """The task a request runs with (None: the base model), held in flight until ``release``."""
        if task_id is None:
            if weights is not None or config is not None:
                raise PeftError("lora_task_id must be set for LoRA inference")
            return None
        if weights is None and config is None:
            cached = self._tasks.get(task_id)
            if cached is None:
                self.stats.cache_misses[task_id] += 1
                raise PeftError(f"LoRA task {task_id} not found in cache. Please send LoRA weights with request")
            task = cached
        else:
            task = self._put(read_task(task_id, weights, config, self._max_rank))
        self._tasks.move_to_end(task_id)
        self._in_flight[task_id] += 1
        return task

    def release(self, task: LoraTask) -> None:
        self._in_flight[task.task_id] -= 1
        if self._in_flight[task.task_id] <= 0:
            del self._in_flight[task.task_id]
            self.released_at[task.task_id] = time.time()

    @property
    def cached(self) -> list[int]:
        """Cached task ids, least recently used first."""
        return list(self._tasks)

    @property
    def in_flight(self) -> dict[int, int]:
        return dict(self._in_flight)

    def _put(self, task: LoraTask) -> LoraTask:
        self.stats.weights_received[task.task_id] += 1
        self.weights_at[task.task_id] = time.time()
        cached = self._tasks.get(task.task_id)
        if cached is not None:  # weights sent again for a cached task: TensorRT-LLM keeps the copy it has
            return cached
        if len(self._tasks) >= self.capacity:
            victim = next((task_id for task_id in self._tasks if not self._in_flight[task_id]), None)
            if victim is None:
                self.stats.cache_full_errors[task.task_id] += 1
                # TensorRT-LLM says "Cache is full. There are no done tasks to evict"; the prefix names the cache.
                raise PeftError("PEFT Cache is full. There are no done tasks to evict")
            self._adapters.forget(self._tasks.pop(victim).adapter)
            self.stats.evictions[victim] += 1
        self._tasks[task.task_id] = task
        self._adapters.remember(AdapterInfo(name=task.adapter, path=f"lora_task_id:{task.task_id}", rank=task.rank))
        return task
