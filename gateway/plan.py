"""``tenantgate plan``: does a fleet plan fit in GPU memory, and what is the most it can hold? Arithmetic only,
from numbers an operator knows, every step printed so it can be checked by hand.

Per replica, memory goes to: the base weights, the resident adapters (working set x adapter size), and the KV
cache of the sequences in flight (concurrent sequences x context tokens x KV bytes per token), within the GPU's
memory less a headroom share (activations, CUDA graphs, fragmentation).

A LoRA adapter of rank r on a module of shape d_in x d_out adds r x (d_in + d_out) parameters; with hidden size h
and square target modules that is 2 r h per module and layer. KV per token is 2 (K and V) x layers x KV heads x
head dim x bytes per value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    working_set: int
    concurrent_sequences: int
    context_tokens: int
    kv_heads: int
    head_dim: int
    bytes_per_value: int = 2
    headroom: float = 0.1
    replicas: int = 1
    adapter_mib: float | None = None  # measured size, instead of the rank arithmetic


@dataclass(frozen=True)
class PlanResult:
    usable_bytes: float
    base_bytes: float
    adapter_bytes: float
    kv_bytes_per_token: int
    kv_bytes: float
    adapters_bytes: float
    free_bytes: float
    fits: bool
    max_working_set: int
    max_concurrent_sequences: int
    warm_tenants: int
    lines: list[str]


def compute(p: PlanInputs) -> PlanResult:
    lines: list[str] = []
    usable = p.gpu_memory_gib * GIB * (1 - p.headroom)
    lines.append(f"usable memory      = {p.gpu_memory_gib} GiB x (1 - {p.headroom}) = {usable / GIB:.2f} GiB")
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
    adapters = p.working_set * adapter
    lines.append(f"working set        = {p.working_set} x {adapter / MIB:.1f} MiB = {adapters / GIB:.3f} GiB")
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
    free = usable - base - adapters - kv
    fits = free >= 0
    lines.append(
        f"left               = {usable / GIB:.2f} - {base / GIB:.2f} - {adapters / GIB:.3f} - {kv / GIB:.2f}"
        f" = {free / GIB:.2f} GiB: {'fits' if fits else 'does NOT fit'}"
    )
    max_working_set = max(0, math.floor((usable - base - kv) / adapter)) if adapter else 0
    lines.append(
        f"largest working set with this KV cache = floor(({usable / GIB:.2f} - {base / GIB:.2f} - {kv / GIB:.2f})"
        f" GiB / {adapter / MIB:.1f} MiB) = {max_working_set}"
    )
    per_sequence = p.context_tokens * kv_token
    max_sequences = max(0, math.floor((usable - base - adapters) / per_sequence)) if per_sequence else 0
    lines.append(
        f"most concurrent sequences with this working set = floor(({usable / GIB:.2f} - {base / GIB:.2f} -"
        f" {adapters / GIB:.3f}) GiB / {per_sequence / MIB:.0f} MiB) = {max_sequences}"
    )
    warm = min(p.working_set, max_working_set) * p.replicas
    lines.append(
        f"tenants kept warm (one adapter each) = {min(p.working_set, max_working_set)} x {p.replicas} replicas = {warm}"
    )
    return PlanResult(
        usable, base, adapter, kv_token, kv, adapters, free, fits, max_working_set, max_sequences, warm, lines
    )
