"""A paged KV cache with per-adapter prefix caching, as vLLM's block manager behaves.

Prompts are split into fixed-size blocks. A full prompt block is content-addressed by the chain hash of every
token before it and the adapter (KV state computed under one adapter is useless under another), so a repeat
prompt on the same adapter finds its leading blocks cached and pays prefill only for the rest. Blocks that no
running request references stay cached until capacity is needed, then go least recently used first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class Allocation:
    """What one admitted request holds until it finishes."""

    prompt_blocks: list[bytes] = field(default_factory=list)
    private_blocks: int = 0
    cached_tokens: int = 0


class KVCache:
    def __init__(self, total_blocks: int, block_size: int) -> None:
        self.total_blocks = total_blocks
        self.block_size = block_size
        self._refcounts: dict[bytes, int] = {}
        # Cached blocks that no request references, least recently used first.
        self._evictable: OrderedDict[bytes, None] = OrderedDict()
        self._private_in_use = 0
        self.evicted_blocks = 0

    def block_keys(self, adapter: str, tokens: list[str]) -> list[bytes]:
        keys: list[bytes] = []
        running = hashlib.sha256(adapter.encode())
        full = len(tokens) - len(tokens) % self.block_size
        for start in range(0, full, self.block_size):
            running.update("\x00".join(tokens[start : start + self.block_size]).encode())
            keys.append(running.copy().digest())
        return keys

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self._private_in_use - len(self._refcounts)

    @property
    def usage(self) -> float:
        """Share of blocks held by running requests, as ``vllm:kv_cache_usage_perc`` (0..1)."""
        referenced = len(self._refcounts) - len(self._evictable)
        return (self._private_in_use + referenced) / self.total_blocks

    def try_allocate(self, keys: list[bytes], prompt_len: int, max_new_tokens: int) -> Allocation | None:
        """Reserve blocks for a whole request, reusing its cached prefix; None if the cache cannot hold it now."""
        hits = 0
        for key in keys:
            if key not in self._refcounts:
                break
            hits += 1
        # As in vLLM, the last prompt token is always computed, so a fully cached prompt gives back one block.
        if hits and hits * self.block_size >= prompt_len:
            hits -= 1
        total_needed = -(-(prompt_len + max_new_tokens) // self.block_size)
        private = total_needed - len(keys)
        new_needed = (len(keys) - hits) + private
        reusable = sum(1 for key in keys[:hits] if key in self._evictable)
        if new_needed > self.free_blocks + len(self._evictable) - reusable:
            return None
        for key in keys[:hits]:
            self._refcounts[key] += 1
            self._evictable.pop(key, None)
        self._evict_until_free(new_needed)
        for key in keys[hits:]:
            if key in self._refcounts:  # cached but recomputed (the last block, or one past an evicted block)
                self._refcounts[key] += 1
                self._evictable.pop(key, None)
            else:
                self._refcounts[key] = 1
        self._private_in_use += private
        return Allocation(prompt_blocks=list(keys), private_blocks=private, cached_tokens=hits * self.block_size)

    def release(self, allocation: Allocation) -> None:
        for key in allocation.prompt_blocks:
            count = self._refcounts[key] - 1
            self._refcounts[key] = count
            if count == 0:
                self._evictable[key] = None
                self._evictable.move_to_end(key)
        self._private_in_use -= allocation.private_blocks
        allocation.prompt_blocks = []
        allocation.private_blocks = 0

    def _evict_until_free(self, needed: int) -> None:
        while self.free_blocks < needed and self._evictable:
            key, _ = self._evictable.popitem(last=False)
            del self._refcounts[key]
            self.evicted_blocks += 1
