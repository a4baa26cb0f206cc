"""The simulated TensorRT-LLM PEFT cache on its own: validation texts, LRU eviction of idle tasks, and what it
tells the engine's adapter caches (no I/O, no clock)."""

from __future__ import annotations

import random
import re
from typing import Any

import numpy as np
import pytest

from loadtests.sim.adapters import AdapterCaches
from loadtests.sim.defaults import SimParams
from loadtests.sim.peft_cache import PeftCache, PeftError, read_task
from loadtests.sim.stats import SimStats

Tensor = np.ndarray[Any, Any]


def _lora(rows: list[list[int]], width: int = 32, seed: int = 0) -> tuple[Tensor, Tensor]:
    weights = np.random.default_rng(seed).standard_normal((1, len(rows), width)).astype(np.float16)
    return weights, np.array([rows], dtype=np.int32)


def _cache(capacity: int = 2) -> tuple[PeftCache, AdapterCaches]:
    adapters = AdapterCaches(SimParams(), SimStats(), random.Random(0))
    return PeftCache(capacity, max_rank=8, adapters=adapters), adapters


@pytest.mark.parametrize(
    ("weights", "config", "message"),
    [
        pytest.param(np.zeros((1, 1, 8), np.float16), None, "must have both lora_weights and lora_keys",
                     id="no-config"),
        pytest.param(np.zeros((1, 8), np.float16), np.zeros((1, 1, 3), np.int32), "Invalid shape for lora_weights",
                     id="weights-2d"),
        pytest.param(np.zeros((2, 1, 8), np.float16), np.zeros((2, 1, 3), np.int32), "batch dimension to be 1",
                     id="batch-2"),
        pytest.param(np.zeros((1, 2, 8), np.float16), np.array([[[1, 0, 8]]], np.int32),
                     "dim1 lora_weights and lora_keys to have the same size", id="rows-differ"),
        pytest.param(*_lora([[22, 0, 8]]), "lora module 22 not enabled for this model", id="module-22"),
        pytest.param(*_lora([[1, -1, 8]]), "Expected layerId to be in the range", id="negative-layer"),
        pytest.param(*_lora([[1, 0, 0]]), "Invalid low_rank (0). low_rank must be greater than 0", id="rank-0"),
        pytest.param(*_lora([[1, 0, 16]]), "less than max_low_rank (8)", id="rank-16"),
    ],
)  # fmt: skip
def test_lora_tensors_are_validated_as_tensorrt_llm_does(weights: Tensor, config: Tensor | None, message: str) -> None:
    with pytest.raises(PeftError) as caught:
        read_task(5, weights, config, max_rank=8)
    assert message in str(caught.value)


def test_a_task_costs_its_largest_rank_and_is_named_for_the_engine() -> None:
    task = read_task(5, *_lora([[1, 0, 4], [3, 0, 8]]), max_rank=8)
    assert (task.task_id, task.rank, task.adapter) == (5, 8, "task-5")


def test_the_digest_tells_weights_apart() -> None:
    one, other = read_task(1, *_lora([[1, 0, 8]], seed=1), 8), read_task(1, *_lora([[1, 0, 8]], seed=2), 8)
    assert one.digest != other.digest
    assert read_task(1, *_lora([[1, 0, 8]], seed=1), 8).digest == one.digest


def test_idle_tasks_are_evicted_least_recently_used_first_and_forgotten() -> None:
    cache, adapters = _cache()
    for task_id in (1, 2):
        task = cache.acquire(task_id, *_lora([[1, 0, 4]]))
        assert task is not None
        cache.release(task)
    touched = cache.acquire(1, None, None)  # by id only: now 2 is the least recently used
    assert touched is not None
    cache.release(touched)
    third = cache.acquire(3, *_lora([[1, 0, 4]]))
    assert third is not None
    assert cache.cached == [1, 3]
    assert cache.stats.evictions == {2: 1}
    assert "task-2" not in adapters.registered and {"task-1", "task-3"} <= set(adapters.registered)
    miss = re.escape("LoRA task 2 not found in cache. Please send LoRA weights with request")
    with pytest.raises(PeftError, match=miss):
        cache.acquire(2, None, None)
    assert cache.stats.cache_misses == {2: 1}


def test_a_cache_of_busy_tasks_is_full_until_one_is_released() -> None:
    cache, _ = _cache()
    busy = [cache.acquire(task_id, *_lora([[1, 0, 4]])) for task_id in (1, 2)]
    with pytest.raises(PeftError, match=re.escape("PEFT Cache is full. There are no done tasks to evict")):
        cache.acquire(3, *_lora([[1, 0, 4]]))
    assert cache.stats.cache_full_errors == {3: 1}
    assert busy[0] is not None
    cache.release(busy[0])
    assert cache.acquire(3, *_lora([[1, 0, 4]])) is not None
    assert cache.cached == [2, 3] and cache.in_flight == {2: 1, 3: 1}
    assert cache.stats.weights_received == {1: 1, 2: 1, 3: 2}


def test_weights_without_a_task_id_are_refused_and_the_base_model_needs_none() -> None:
    cache, _ = _cache()
    assert cache.acquire(None, None, None) is None
    with pytest.raises(PeftError, match="lora_task_id must be set for LoRA inference"):
        cache.acquire(None, *_lora([[1, 0, 4]]))


def test_weights_sent_again_keep_the_cached_copy() -> None:
    cache, _ = _cache()
    first = cache.acquire(1, *_lora([[1, 0, 4]], seed=1))
    again = cache.acquire(1, *_lora([[1, 0, 4]], seed=2))
    assert first is not None and again == first
    assert cache.stats.weights_received == {1: 2} and cache.in_flight == {1: 2}
