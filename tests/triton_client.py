"""Raw tritonclient requests to a Triton-protocol engine, as the engine lanes' tests build them: the tensors of
the TensorRT-LLM contract (docs/triton.md) and readers for the responses."""

from __future__ import annotations

from typing import Any

import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

Arrays = dict[str, np.ndarray[Any, Any]]
Result = tuple[grpcclient.InferResult | None, InferenceServerException | None]


def lora_arrays(rank: int = 8, rows: int = 2, seed: int = 0) -> Arrays:
    """Weights and config of the converter's shapes: [1,N,W] fp16 and [1,N,3] int32 rows of (module, layer, rank)."""
    weights = np.random.default_rng(seed).standard_normal((1, rows, 4 * rank)).astype(np.float16)
    config = np.array([[[1 + row % 2, row // 2, rank] for row in range(rows)]], dtype=np.int32)
    return {"lora_weights": weights, "lora_config": config}


def request_arrays(
    prompt: str = "the gateway routes each tenant",
    max_tokens: int = 12,
    stream: bool = False,
    lora_task_id: int | None = None,
    exclude_input: bool = True,
    counts: bool = True,
    **extra: np.ndarray[Any, Any],
) -> Arrays:
    arrays: Arrays = {
        "text_input": np.array([[prompt]], dtype=object),
        "max_tokens": np.array([[max_tokens]], dtype=np.int32),
        "stream": np.array([[stream]], dtype=bool),
        "exclude_input_in_output": np.array([[exclude_input]], dtype=bool),
    }
    if counts:
        arrays["return_num_input_tokens"] = np.array([[True]], dtype=bool)
        arrays["return_num_output_tokens"] = np.array([[True]], dtype=bool)
    if lora_task_id is not None:
        arrays["lora_task_id"] = np.array([[lora_task_id]], dtype=np.uint64)
    return {**arrays, **extra}


def infer_inputs(arrays: Arrays) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def text(result: grpcclient.InferResult) -> str:
    value: bytes = result.as_numpy("text_output").reshape(-1)[0]
    return value.decode()


def counts(result: grpcclient.InferResult) -> tuple[int, int]:
    return int(result.as_numpy("num_input_tokens")[0, 0]), int(result.as_numpy("num_output_tokens")[0, 0])


def answer(results: list[Result]) -> grpcclient.InferResult:
    """The one response of a successful non-streaming request."""
    assert [error for _, error in results] == [None], results
    result = results[0][0]
    assert result is not None
    return result


def error_message(results: list[Result]) -> str:
    """The message of a refused request: one in-stream error and nothing else."""
    assert len(results) == 1 and results[0][0] is None and results[0][1] is not None, results
    return str(results[0][1].message())
