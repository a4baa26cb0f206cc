"""`tenantgate plan` against cases computed by hand."""

from __future__ import annotations

import pytest

from gateway.cli import main
from gateway.plan import GIB, MIB, PlanInputs, compute

LLAMA_8B = {
    "gpu_memory_gib": 80, "base_weights_gib": 16, "hidden_size": 4096, "layers": 32, "adapter_rank": 16,
    "target_modules": 4, "working_set": 16, "concurrent_sequences": 64, "context_tokens": 4096, "kv_heads": 8,
    "head_dim": 128, "replicas": 4,
}  # fmt: skip


def test_an_8b_model_on_an_80_gib_gpu() -> None:
    result = compute(PlanInputs(**LLAMA_8B))
    # By hand: adapter 2*16*4096*4*32*2 B = 32 MiB; KV/token 2*32*8*128*2 B = 128 KiB;
    # KV 64*4096*128 KiB = 32 GiB; usable 72 GiB; left 72 - 16 - 0.5 - 32 = 23.5 GiB.
    assert result.adapter_bytes == 32 * MIB
    assert result.kv_bytes_per_token == 128 * 1024
    assert result.kv_bytes == 32 * GIB
    assert result.free_bytes == pytest.approx(23.5 * GIB)
    assert result.fits
    assert result.max_working_set == 768  # (72 - 16 - 32) GiB / 32 MiB
    assert result.max_concurrent_sequences == 111  # (72 - 16 - 0.5) GiB / 512 MiB = 111.0
    assert result.warm_tenants == 64


def test_a_plan_that_does_not_fit() -> None:
    # 24 GiB GPU, headroom 0: usable 24; base 16; KV 16 seqs * 4096 * 128 KiB = 8 GiB; adapters 8 * 32 MiB = 0.25.
    result = compute(PlanInputs(**{**LLAMA_8B, "gpu_memory_gib": 24, "headroom": 0, "working_set": 8,
                                   "concurrent_sequences": 16}))  # fmt: skip
    assert result.free_bytes == pytest.approx(-0.25 * GIB)
    assert not result.fits
    assert result.max_working_set == 0  # (24 - 16 - 8) / 32 MiB
    assert result.max_concurrent_sequences == 15  # (24 - 16 - 0.25) GiB / 512 MiB = 15.5
    assert result.warm_tenants == 0


def test_a_measured_adapter_size_replaces_the_arithmetic(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan"] + [f"--{k.replace('_', '-')}={v}" for k, v in LLAMA_8B.items()] + ["--adapter-mib", "100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "one adapter        = 100.0 MiB (measured)" in out
    assert "largest working set with this KV cache = floor((72.00 - 16.00 - 32.00) GiB / 100.0 MiB) = 245" in out
