"""PEFT -> TensorRT-LLM LoRA conversion, checked against cases small enough to compute by hand."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file
from tritonclient.grpc import InferInput

from backends.lora_weights import AdapterFormatError, convert_peft, task_id
from loadtests.peft_files import TINY_SHAPES, write_peft_adapter

PREFIX = "base_model.model.model.layers"


def _adapter(root: Path, tensors: dict[str, list[list[float]]], **config: object) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    save_file(
        {key: np.array(value, dtype=np.float32) for key, value in tensors.items()},
        str(root / "adapter_model.safetensors"),
    )
    (root / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    return root


def test_one_module_by_hand(tmp_path: Path) -> None:
    # rank 1, q_proj 2 -> 3 features, alpha 2: scale 2 goes into B only.
    root = _adapter(
        tmp_path,
        {
            f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": [[1.0, 2.0]],
            f"{PREFIX}.0.self_attn.q_proj.lora_B.weight": [[3.0], [4.0], [5.0]],
        },
        r=1,
        lora_alpha=2,
    )
    converted = convert_peft(root)
    assert converted.weights.dtype == np.float16
    assert converted.weights_datatype == "FP16"
    assert converted.weights.tolist() == [[[1.0, 2.0, 6.0, 8.0, 10.0]]]
    assert converted.config.dtype == np.int32
    assert converted.config.tolist() == [[[1, 0, 1]]]  # attn_q, layer 0, rank 1


def test_rows_by_layer_then_module_padded_to_the_longest(tmp_path: Path) -> None:
    # rank 1, alpha 1 (scale 1). Layer 1 has up_proj (id 7, 2 -> 1) and gate_proj (id 5, 2 -> 2);
    # layer 0 has v_proj (id 3, 1 -> 1). Expected order: (0, v), (1, gate), (1, up).
    root = _adapter(
        tmp_path,
        {
            f"{PREFIX}.1.mlp.up_proj.lora_A.weight": [[1.0, 1.0]],
            f"{PREFIX}.1.mlp.up_proj.lora_B.weight": [[2.0]],
            f"{PREFIX}.1.mlp.gate_proj.lora_A.weight": [[3.0, 4.0]],
            f"{PREFIX}.1.mlp.gate_proj.lora_B.weight": [[5.0], [6.0]],
            f"{PREFIX}.0.self_attn.v_proj.lora_A.weight": [[7.0]],
            f"{PREFIX}.0.self_attn.v_proj.lora_B.weight": [[8.0]],
        },
        r=1,
        lora_alpha=1,
    )
    converted = convert_peft(root, "float32")
    assert converted.config.tolist() == [[[3, 0, 1], [5, 1, 1], [7, 1, 1]]]
    assert converted.weights.tolist() == [[[7.0, 8.0, 0.0, 0.0], [3.0, 4.0, 5.0, 6.0], [1.0, 1.0, 2.0, 0.0]]]


def test_rslora_scale_and_transposed_matrices(tmp_path: Path) -> None:
    # rank 4 with use_rslora: scale = alpha / sqrt(4) = 8 / 2 = 4. A stored as [in, r], B as [r, out].
    a = [[1.0, 0.0, 0.0, 0.0]]  # [in=1, r=4]
    b = [[1.0], [0.0], [0.0], [2.0]]  # [r=4, out=1]
    root = _adapter(
        tmp_path,
        {f"{PREFIX}.0.self_attn.o_proj.lora_A.weight": a, f"{PREFIX}.0.self_attn.o_proj.lora_B.weight": b},
        r=4,
        lora_alpha=8,
        use_rslora=True,
    )
    converted = convert_peft(root, "float32")
    assert converted.config.tolist() == [[[4, 0, 4]]]
    assert converted.weights.tolist() == [[[1.0, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0, 8.0]]]


def test_a_peft_adapter_made_by_the_tests(tmp_path: Path) -> None:
    """Shapes, module ids and ranks of a whole adapter (2 layers, all seven Llama projections, rank 8)."""
    modules = tuple(TINY_SHAPES)
    root = write_peft_adapter(tmp_path / "a", 8, modules=modules, layers=2)
    converted = convert_peft(root)
    widest = max(8 * (fan_in + fan_out) for fan_in, fan_out in TINY_SHAPES.values())
    assert converted.weights.shape == (1, 14, widest)
    assert converted.config.shape == (1, 14, 3)
    ids = {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "down_proj": 6, "up_proj": 7}
    expected = [[module_id, layer, 8] for layer in (0, 1) for module_id in sorted(ids.values())]
    assert converted.config[0].tolist() == expected
    # Each row holds exactly its 8*(in+out) numbers, then zeros; gate_proj (id 5) is the widest row here.
    by_id = {module_id: name for name, module_id in ids.items()}
    for row, (module_id, _, _) in zip(converted.weights[0], expected, strict=True):
        fan_in, fan_out = TINY_SHAPES[by_id[module_id]]
        used = 8 * (fan_in + fan_out)
        assert np.count_nonzero(row[:used]) == used and not row[used:].any()


def test_bfloat16_weights_make_a_bf16_tensor(tmp_path: Path) -> None:
    converted = convert_peft(write_peft_adapter(tmp_path / "a", 2), "bfloat16")
    assert converted.weights.dtype == ml_dtypes.bfloat16 and converted.weights_datatype == "BF16"
    tensor = InferInput("lora_weights", list(converted.weights.shape), converted.weights_datatype)
    tensor.set_data_from_numpy(converted.weights)  # tritonclient refuses any other array type for BF16


@pytest.mark.parametrize(
    ("tensors", "config", "message"),
    [
        ({}, {"r": 2}, "no LoRA A/B matrices"),
        ({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": [[1.0, 1.0]]}, {"r": 2}, "lacks lora_A or lora_B"),
        (
            {f"{PREFIX}.0.mlp.w_in.lora_A.weight": [[1.0]], f"{PREFIX}.0.mlp.w_in.lora_B.weight": [[1.0]]},
            {"r": 1},
            "'w_in' has no TensorRT-LLM LoRA module",
        ),
        (
            {f"{PREFIX}.0.mlp.up_proj.lora_A.weight": [[1.0]], f"{PREFIX}.0.mlp.up_proj.lora_B.weight": [[1.0]]},
            {"r": 3},
            "do not match rank 3",
        ),
        ({f"{PREFIX}.0.mlp.up_proj.lora_A.weight": [[1.0]]}, {"r": 0}, "no positive integer rank"),
        ({f"{PREFIX}.0.mlp.up_proj.lora_A.weight": [[1.0]]}, {"r": 1, "peft_type": "IA3"}, "not a LoRA adapter"),
        ({f"{PREFIX}.0.mlp.up_proj.lora_A.weight": [[1.0]]}, {"r": "8"}, "no positive integer rank"),
        ({f"{PREFIX}.0.mlp.up_proj.lora_A.weight": [[1.0]]}, {"r": 1, "lora_alpha": "x"}, "'lora_alpha' must be"),
        ({f"{PREFIX}.0.mlp.up_proj.lora_A.weight": [[1.0]]}, {"r": 1, "use_dora": True}, "use_dora adapters"),
        ({f"{PREFIX}.0.mlp.up_proj.lora_A.weight": [[1.0]]}, {"r": 1, "alpha_pattern": {"q": 2}}, "alpha_pattern"),
        ({"base_model.model.lm_head.lora_A.weight": [[1.0]]}, {"r": 1}, "lm_head.lora_A.weight has no place"),
    ],
)
def test_refusals_name_the_problem(
    tmp_path: Path, tensors: dict[str, list[list[float]]], config: dict[str, object], message: str
) -> None:
    root = _adapter(tmp_path, tensors or {"unrelated.weight": [[0.0]]}, **config)
    with pytest.raises(AdapterFormatError, match=message):
        convert_peft(root)


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(AdapterFormatError, match=r"no adapter_config\.json"):
        convert_peft(tmp_path / "absent")


def test_task_ids_are_stable_positive_63_bit_and_distinct() -> None:
    assert task_id("support@1", "/srv/a") == task_id("support@1", "/srv/a")
    ids = {task_id(f"adapter-{n}", "/srv/a") for n in range(5000)}
    assert len(ids) == 5000
    assert all(0 < value < 2**63 for value in ids)
    # A name reused for other weights (another source) is another task: the engine's cache cannot serve the old.
    assert task_id("support@1", "/srv/b") != task_id("support@1", "/srv/a")
    # Pinned: a change of derivation would silently invalidate every engine's PEFT cache entries.
    assert task_id("a1", "/srv/loras/a1") == 8718896991693282456
