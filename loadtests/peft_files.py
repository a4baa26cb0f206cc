"""Small Hugging Face PEFT LoRA adapters written with numpy and safetensors (no torch), for the Triton lanes and
the weight-conversion tests: the same files `peft.save_pretrained` writes (adapter_config.json +
adapter_model.safetensors), with seeded weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

# (in, out) features of each projection in a tiny Llama: hidden 16, MLP 32, 4 heads of 4 (kv heads 2).
TINY_SHAPES: dict[str, tuple[int, int]] = {
    "q_proj": (16, 16),
    "k_proj": (16, 8),
    "v_proj": (16, 8),
    "o_proj": (16, 16),
    "gate_proj": (16, 32),
    "up_proj": (16, 32),
    "down_proj": (32, 16),
}
_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}


def write_peft_adapter(
    directory: Path,
    rank: int,
    *,
    layers: int = 2,
    modules: tuple[str, ...] = ("q_proj", "v_proj"),
    alpha: float | None = None,
    seed: int = 0,
    dtype: type = np.float32,
) -> Path:
    """A PEFT adapter directory with seeded weights; key names as peft writes them for a Llama model."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for layer in range(layers):
        for module in modules:
            fan_in, fan_out = TINY_SHAPES[module]
            prefix = f"base_model.model.model.layers.{layer}.{_BLOCK.get(module, 'mlp')}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((rank, fan_in)).astype(dtype)
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((fan_out, rank)).astype(dtype)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha if alpha is not None else 2 * rank,
        "target_modules": list(modules),
        "use_rslora": False,
        "task_type": "CAUSAL_LM",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory
