"""``tenantgate plan``: does a fleet plan fit in GPU (and host) memory, and what is the most it can hold?
Arithmetic only, from numbers an operator knows, every step printed so it can be checked by hand.

Per replica, GPU memory goes to: the base weights, the adapters' GPU slots (vLLM's ``--max-loras``: the engine
sets that many slots aside whether they are used or not), and the KV cache of the sequences in flight (concurrent
sequences x context tokens x KV bytes per token), within the GPU's memory less a headroom share (activations,
CUDA graphs, fragmentation). The working set the gateway plans for (``max_adapters``, the engine's
``--max-cpu-loras``) lives in the engine's host-memory cache, not on the GPU: it is checked against host memory
when that is given.

A LoRA adapter of rank r on a module of shape d_in x d_out adds r x (d_in + d_out) parameters; with hidden size h
and square target modules that is 2 r h per module and layer. KV per token is 2 (K and V) x layers x KV heads x
head dim x bytes per value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class PlanInputs:
    gpu_memory_gib: float
    base_weights_gib: float
    hidden_size: int
    layers: int
    adapter_rank: int
    target_modules: int
    working_set: int  # max_adapters: the engine's host-memory adapter cache (--max-cpu-loras)
    concurrent_sequences: int
    context_tokens: int
    kv_heads: int
    head_dim: int
    gpu_slots: int = 1  # the engine's GPU adapter slots (vLLM --max-loras, default 1)
    bytes_per_value: int = 2
    headroom: float = 0.1
    replicas: int = 1
    adapter_mib: float | None = None  # measured size, instead of the rank arithmetic
    host_memory_gib: float | None = None  # host memory the engine may give its adapter cache

    def __post_init__(self) -> None:
        """Every count and size is positive (a negative one would make any plan fit); headroom is a share."""
        problems = [
            f"{f.name.replace('_', '-')} must be positive (got {value})"
            for f in fields(self)
            if f.name != "headroom" and (value := getattr(self, f.name)) is not None and not value > 0
        ]
        if not 0 <= self.headroom < 1:
            problems.append(f"headroom must be at least 0 and below 1 (got {self.headroom})")
        if self.gpu_slots > self.working_set:
            problems.append(
                f"gpu-slots ({self.gpu_slots}) must not exceed working-set ({self.working_set}): an adapter in a GPU"
                " slot is also in the host cache (vLLM refuses --max-cpu-loras below --max-loras)"
            )
        if problems:
            raise ValueError("; ".join(problems))


@dataclass(frozen=True)
class PlanResult:
    usable_bytes: float
    base_bytes: float
    adapter_bytes: float
    kv_bytes_per_token: int
    kv_bytes: float
    gpu_adapters_bytes: float
    host_cache_bytes: float
    free_bytes: float
    fits: bool
    max_gpu_slots: int
    max_working_set: int | None  # by host memory, when given
    max_concurrent_sequences: int
    warm_tenants: int
    lines: list[str]


def compute(p: PlanInputs) -> PlanResult:
    lines: list[str] = []
    usable = p.gpu_memory_gib * GIB * (1 - p.headroom)
    lines.append(f"usable GPU memory  = {p.gpu_memory_gib} GiB x (1 - {p.headroom}) = {usable / GIB:.2f} GiB")
    base = p.base_weights_gib * GIB
    lines.append(f"base weights       = {p.base_weights_gib:.2f} GiB")
    if p.adapter_mib is not None:
        adapter = p.adapter_mib * MIB
        lines.append(f"one adapter        = {p.adapter_mib} MiB (measured)")
    else:
        adapter = 2 * p.adapter_rank * p.hidden_size * p.target_modules * p.layers * p.bytes_per_value
        lines.append(
            f"one adapter        = 2 x rank {p.adapter_rank} x hidden {p.hidden_size} x {p.target_modules} modules"
            f" x {p.layers} layers x {p.bytes_per_value} B = {adapter / MIB:.1f} MiB"
        )
    gpu_adapters = p.gpu_slots * adapter
    lines.append(f"GPU adapter slots  = {p.gpu_slots} x {adapter / MIB:.1f} MiB = {gpu_adapters / GIB:.3f} GiB")
    kv_token = 2 * p.layers * p.kv_heads * p.head_dim * p.bytes_per_value
    lines.append(
        f"KV per token       = 2 x {p.layers} layers x {p.kv_heads} KV heads x {p.head_dim} x {p.bytes_per_value} B"
        f" = {kv_token / 1024:.0f} KiB"
    )
    kv = p.concurrent_sequences * p.context_tokens * kv_token
    lines.append(
        f"KV cache           = {p.concurrent_sequences} sequences x {p.context_tokens} tokens x"
        f" {kv_token / 1024:.0f} KiB = {kv / GIB:.2f} GiB"
    )
    free = usable - base - gpu_adapters - kv
    fits = free >= 0
    lines.append(
        f"GPU left           = {usable / GIB:.2f} - {base / GIB:.2f} - {gpu_adapters / GIB:.3f} - {kv / GIB:.2f}"
        f" = {free / GIB:.2f} GiB: {'fits' if fits else 'does NOT fit'}"
    )
    host_cache = p.working_set * adapter
    lines.append(
        f"host adapter cache = working set {p.working_set} x {adapter / MIB:.1f} MiB = {host_cache / GIB:.3f} GiB"
        " (host memory, not GPU)"
    )
    max_working_set = None
    if p.host_memory_gib is not None:
        host = p.host_memory_gib * GIB
        host_fits = host_cache <= host
        fits = fits and host_fits
        max_working_set = math.floor(host / adapter)
        lines.append(
            f"host memory        = {p.host_memory_gib:.2f} GiB: the cache {'fits' if host_fits else 'does NOT fit'};"
            f" largest working set = floor({p.host_memory_gib:.2f} GiB / {adapter / MIB:.1f} MiB) = {max_working_set}"
        )
    max_gpu_slots = max(0, math.floor((usable - base - kv) / adapter))
    lines.append(
        f"most GPU adapter slots with this KV cache = floor(({usable / GIB:.2f} - {base / GIB:.2f} - {kv / GIB:.2f})"
        f" GiB / {adapter / MIB:.1f} MiB) = {max_gpu_slots}"
    )
    per_sequence = p.context_tokens * kv_token
    max_sequences = max(0, math.floor((usable - base - gpu_adapters) / per_sequence))
    lines.append(
        f"most concurrent sequences with these slots = floor(({usable / GIB:.2f} - {base / GIB:.2f} -"
        f" {gpu_adapters / GIB:.3f}) GiB / {per_sequence / MIB:.0f} MiB) = {max_sequences}"
    )
    cached = p.working_set if max_working_set is None else min(p.working_set, max_working_set)
    warm = cached * p.replicas if fits else 0
    lines.append(f"tenants kept warm (one adapter each, in the host cache) = {cached} x {p.replicas} replicas = {warm}")
    return PlanResult(
        usable, base, adapter, kv_token, kv, gpu_adapters, host_cache, free, fits, max_gpu_slots, max_working_set,
        max_sequences, warm, lines,
    )  # fmt: skip
