"""`tenantgate plan` against cases computed by hand."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from gateway.plan import GIB, MIB, PlanInputs, compute

LLAMA_8B = {
    "gpu_memory_gib": 80, "base_weights_gib": 16, "hidden_size": 4096, "layers": 32, "adapter_rank": 16,
    "target_modules": 4, "working_set": 16, "gpu_slots": 4, "concurrent_sequences": 64, "context_tokens": 4096,
    "kv_heads": 8, "head_dim": 128, "replicas": 4,
}  # fmt: skip


def test_an_8b_model_on_an_80_gib_gpu() -> None:
    result = compute(PlanInputs(**LLAMA_8B))
    # By hand: adapter 2*16*4096*4*32*2 B = 32 MiB; KV/token 2*32*8*128*2 B = 128 KiB;
    # KV 64*4096*128 KiB = 32 GiB; usable 72 GiB; 4 GPU slots 0.125 GiB; left 72 - 16 - 0.125 - 32 = 23.875 GiB.
    # The 16-adapter working set (0.5 GiB) is the engine's host cache: not GPU memory.
    assert result.adapter_bytes == 32 * MIB
    assert result.kv_bytes_per_token == 128 * 1024
    assert result.kv_bytes == 32 * GIB
    assert result.gpu_adapters_bytes == 4 * 32 * MIB
    assert result.host_cache_bytes == 16 * 32 * MIB
    assert result.free_bytes == pytest.approx(23.875 * GIB)
    assert result.fits
    assert result.max_gpu_slots == 768  # (72 - 16 - 32) GiB / 32 MiB
    assert result.max_working_set is None  # no host memory given
    assert result.max_concurrent_sequences == 111  # (72 - 16 - 0.125) GiB / 512 MiB = 111.75
    assert result.warm_tenants == 64


def test_a_plan_that_does_not_fit() -> None:
    # 24 GiB GPU, headroom 0: usable 24; base 16; KV 16 seqs * 4096 * 128 KiB = 8 GiB; adapters 8 * 32 MiB = 0.25.
    result = compute(PlanInputs(**{**LLAMA_8B, "gpu_memory_gib": 24, "headroom": 0, "gpu_slots": 8,
                                   "concurrent_sequences": 16}))  # fmt: skip
    assert result.free_bytes == pytest.approx(-0.25 * GIB)
    assert not result.fits
    assert result.max_gpu_slots == 0  # (24 - 16 - 8) / 32 MiB
    assert result.max_concurrent_sequences == 15  # (24 - 16 - 0.25) GiB / 512 MiB = 15.5
    assert result.warm_tenants == 0


def test_a_measured_adapter_size_replaces_the_arithmetic(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan"] + [f"--{k.replace('_', '-')}={v}" for k, v in LLAMA_8B.items()] + ["--adapter-mib", "100"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "one adapter        = 100.0 MiB (measured)" in out
    assert "most GPU adapter slots with this KV cache = floor((72.00 - 16.00 - 32.00) GiB / 100.0 MiB) = 245" in out


def test_the_host_memory_cache_is_not_charged_to_the_gpu() -> None:
    small, large = (compute(PlanInputs(**{**LLAMA_8B, "working_set": n})) for n in (16, 4096))
    assert small.free_bytes == large.free_bytes  # 4,096 cached adapters (128 GiB) cost the GPU nothing
    assert large.fits and large.host_cache_bytes == 128 * GIB
    # ... but host memory: 8 GiB holds 256 of them.
    bounded = compute(PlanInputs(**{**LLAMA_8B, "working_set": 4096, "host_memory_gib": 8}))
    assert bounded.max_working_set == 256 and not bounded.fits and bounded.warm_tenants == 0
    fitting = compute(PlanInputs(**{**LLAMA_8B, "working_set": 256, "host_memory_gib": 8}))
    assert fitting.fits and fitting.warm_tenants == 256 * 4


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("base_weights_gib", -16, "base-weights-gib must be positive"),
        ("concurrent_sequences", -64, "concurrent-sequences must be positive"),
        ("gpu_memory_gib", 0, "gpu-memory-gib must be positive"),
        ("adapter_mib", -1, "adapter-mib must be positive"),
        ("headroom", 1.5, "headroom must be at least 0 and below 1"),
        ("gpu_slots", 32, "gpu-slots (32) must not exceed working-set (16)"),
    ],
)
def test_impossible_inputs_are_refused(
    field: str, value: float, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs: dict[str, Any] = {**LLAMA_8B, field: value}
    with pytest.raises(ValueError, match=re.escape(expected)):
        PlanInputs(**inputs)
    argv = ["plan"] + [f"--{k.replace('_', '-')}={v}" for k, v in inputs.items()]
    assert main(argv) == 2
    assert expected in capsys.readouterr().err


def test_the_runbooks_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runbook = (Path(__file__).resolve().parents[2] / "docs/operations.md").read_text()
    [command] = re.findall(r"```sh\n(tenantgate plan .*?)\n```", runbook, re.DOTALL)
    assert main(shlex.split(command.replace("\\\n", " "))[1:]) == 0
    assert (
        "host adapter cache = working set 16 x 32.0 MiB = 0.500 GiB (host memory, not GPU)" in capsys.readouterr().out
    )
