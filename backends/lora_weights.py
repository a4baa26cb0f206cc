"""Hugging Face PEFT LoRA adapters in TensorRT-LLM's layout, and the task ids that name them in its PEFT cache.

TensorRT-LLM takes an adapter as two tensors sent with a request (docs/triton.md): ``lora_weights``, one row per
(layer, module) holding A (``[r, in]``) flattened, then B (``[out, r]``) scaled by alpha/r, zero-padded to the
longest row; and ``lora_config``, one ``[module_id, layer, r]`` row each. This follows TensorRT-LLM's own
converter (examples/hf_lora_convert.py), whose module mapping differs from the stock config.pbtxt's comments.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

# PEFT module name -> TensorRT-LLM module id (TensorRT-LLM runtime/loraModule.h).
MODULE_IDS: dict[str, int] = {
    "qkv_proj": 0,
    "query_key_value": 0,
    "q_proj": 1,
    "k_proj": 2,
    "v_proj": 3,
    "o_proj": 4,
    "dense": 4,
    "gate_proj": 5,  # mlp_h_to_4h, as the converter maps it
    "down_proj": 6,
    "up_proj": 7,  # mlp_gate
}
LORA_DTYPES: dict[str, Any] = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
TRITON_DTYPES = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32"}

_KEY = re.compile(r"\.layers\.(\d+)\.(?:self_attn|mlp|attention|self_attention)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class AdapterFormatError(ValueError):
    """The adapter directory is not a LoRA adapter this converter can turn into TensorRT-LLM's layout."""


@dataclass(frozen=True)
class TrtLoraWeights:
    """One adapter ready to send: ``weights`` [1, rows, width] and ``config`` [1, rows, 3] (leading batch dim)."""

    weights: np.ndarray
    config: np.ndarray
    weights_datatype: str

    @property
    def nbytes(self) -> int:
        return int(self.weights.nbytes + self.config.nbytes)


@functools.lru_cache(maxsize=4096)  # asked on every request through an adapter
def task_id(engine_name: str, source: str) -> int:
    """The adapter's ``lora_task_id``: stable across gateways and restarts, from its engine name and source (a new
    version or a name reused for other weights gets a new id, so the engine can never serve old weights under it).
    Top bit cleared: some clients read it as a signed integer; never 0."""
    key = f"{engine_name}\0{source}".encode()
    digest = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
    return (digest & (2**63 - 1)) or 1


def convert_peft(directory: str | Path, dtype: str = "float16") -> TrtLoraWeights:
    """Read a PEFT adapter directory and lay it out for TensorRT-LLM. Raises ``AdapterFormatError``."""
    if dtype not in LORA_DTYPES:
        raise AdapterFormatError(f"unknown LoRA dtype {dtype!r}; expected one of {sorted(LORA_DTYPES)}")
    root = Path(directory)
    config = _read_config(root)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterFormatError(f"{root}/adapter_config.json has no positive integer rank 'r'")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise AdapterFormatError(f"{root}/adapter_config.json: 'lora_alpha' must be a number")
    # TensorRT-LLM takes one rank and one scale per adapter: variants it cannot express are refused, not approximated.
    for unsupported in ("use_dora", "alpha_pattern", "rank_pattern"):
        if config.get(unsupported):
            raise AdapterFormatError(
                f"{root}: {unsupported} adapters cannot be expressed in TensorRT-LLM's LoRA layout"
            )
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs = _read_pairs(root)
    rows: list[np.ndarray] = []
    config_rows: list[tuple[int, int, int]] = []
    for (layer, module_id), (a, b) in sorted(pairs.items()):
        a, b = _oriented(a, b, rank, f"layer {layer} module {module_id}")
        rows.append(np.concatenate([a.reshape(-1), (b * scale).reshape(-1)]))
        config_rows.append((module_id, layer, rank))
    width = max(row.size for row in rows)
    weights = np.zeros((1, len(rows), width), dtype=LORA_DTYPES[dtype])
    for index, row in enumerate(rows):
        weights[0, index, : row.size] = row
    return TrtLoraWeights(weights, np.array([config_rows], dtype=np.int32), TRITON_DTYPES[dtype])


def _read_config(root: Path) -> dict[str, Any]:
    try:
        config = json.loads((root / "adapter_config.json").read_text())
    except OSError as exc:
        raise AdapterFormatError(f"no adapter_config.json in {root}: {exc.strerror}") from exc
    except ValueError as exc:
        raise AdapterFormatError(f"{root}/adapter_config.json is not JSON: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise AdapterFormatError(f"{root} is not a LoRA adapter (peft_type {kind!r})")
    return config


def _read_pairs(root: Path) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
    """(layer, module id) -> (A, B) as float32, from the safetensors file."""
    try:
        tensors = load_file(str(root / "adapter_model.safetensors"))
    except (OSError, SafetensorError) as exc:
        raise AdapterFormatError(f"cannot read {root}/adapter_model.safetensors: {exc}") from exc
    halves: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            if "lora_" in key:  # a LoRA part this layout cannot hold (embeddings, lm_head, experts, DoRA)
                raise AdapterFormatError(f"{root}: {key} has no place in TensorRT-LLM's per-layer LoRA modules")
            continue  # not a LoRA matrix
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in MODULE_IDS:
            raise AdapterFormatError(f"{root}: module {module!r} has no TensorRT-LLM LoRA module (key {key})")
        halves.setdefault((layer, MODULE_IDS[module]), {})[half] = tensor.astype(np.float32)
    if not halves:
        raise AdapterFormatError(f"{root}/adapter_model.safetensors holds no LoRA A/B matrices of any layer")
    pairs = {}
    for slot, found in halves.items():
        if set(found) != {"A", "B"}:
            raise AdapterFormatError(f"{root}: layer {slot[0]} module id {slot[1]} lacks lora_A or lora_B")
        pairs[slot] = (found["A"], found["B"])
    return pairs


def _oriented(a: np.ndarray, b: np.ndarray, rank: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A as [r, in] and B as [out, r]; some exporters store them transposed."""
    if a.ndim != 2 or b.ndim != 2:
        raise AdapterFormatError(f"{where}: LoRA matrices must be 2-D, got {a.shape} and {b.shape}")
    if a.shape[0] != rank and a.shape[1] == rank:
        a = a.T
    if b.shape[1] != rank and b.shape[0] == rank:
        b = b.T
    if a.shape[0] != rank or b.shape[1] != rank:
        raise AdapterFormatError(f"{where}: shapes {a.shape} and {b.shape} do not match rank {rank}")
    return a, b
