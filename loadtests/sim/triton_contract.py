"""The simulated Triton model's contract: the TensorRT-LLM inputs and outputs of docs/triton.md, declared as
Triton declares them (metadata and config), and each request checked against them as Triton's core does.

The model has ``max_batch_size`` 8, so metadata shapes lead with a -1 batch dimension (``dims: [1]`` is shape
``[-1, 1]``) and requests send ``[1, ...]``. It is decoupled, as ``tensorrt_llm_bls`` is when it streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2

from loadtests.sim.triton_errors import Kind, TritonError, unknown_model
from loadtests.sim.triton_wire import decode_input

MAX_BATCH_SIZE = 8
VERSION = "1"
PLATFORM = "python"  # what Triton reports for a Python-backend model such as tensorrt_llm_bls
# What the server says about itself (GET /v2, ServerMetadata): a Triton 25.x release's name, version, extensions.
SERVER_NAME = "triton"
SERVER_VERSION = "2.59.0"
EXTENSIONS = (
    "classification", "sequence", "model_repository", "model_repository(unload_dependents)", "schedule_policy",
    "model_configuration", "system_shared_memory", "cuda_shared_memory", "binary_tensor_data", "parameters",
    "statistics", "trace", "logging",
)  # fmt: skip


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # KServe v2 name (BYTES, INT32, ...)
    dims: tuple[int, ...]  # as config.pbtxt writes them: without the batch dimension
    optional: bool = True

    @property
    def shape(self) -> list[int]:
        return [-1, *self.dims]


INPUTS = (
    TensorSpec("text_input", "BYTES", (1,), optional=False),
    TensorSpec("max_tokens", "INT32", (1,), optional=False),
    TensorSpec("stream", "BOOL", (1,)),
    TensorSpec("temperature", "FP32", (1,)),
    TensorSpec("top_p", "FP32", (1,)),
    TensorSpec("presence_penalty", "FP32", (1,)),
    TensorSpec("frequency_penalty", "FP32", (1,)),
    TensorSpec("top_k", "INT32", (1,)),
    TensorSpec("seed", "UINT64", (1,)),
    TensorSpec("stop_words", "BYTES", (-1,)),
    TensorSpec("exclude_input_in_output", "BOOL", (1,)),
    TensorSpec("return_num_input_tokens", "BOOL", (1,)),
    TensorSpec("return_num_output_tokens", "BOOL", (1,)),
    TensorSpec("lora_task_id", "UINT64", (1,)),
    TensorSpec("lora_weights", "FP16", (-1, -1)),
    TensorSpec("lora_config", "INT32", (-1, 3)),
)
OUTPUTS = (
    TensorSpec("text_output", "BYTES", (-1,)),
    TensorSpec("num_input_tokens", "INT32", (1,)),
    TensorSpec("num_output_tokens", "INT32", (1,)),
)
_INPUTS = {spec.name: spec for spec in INPUTS}
_OUTPUTS = {spec.name: spec for spec in OUTPUTS}
_CONFIG_TYPES = {"BYTES": "TYPE_STRING"}  # config.pbtxt spells the others TYPE_<name>


@dataclass(frozen=True)
class GenerateRequest:
    """One request as the model reads it. Sampling inputs are checked but not used: the simulator's answers are
    deterministic."""

    request_id: str
    prompt: str
    max_tokens: int
    stop_words: tuple[str, ...]
    stream: bool
    exclude_input_in_output: bool
    return_num_input_tokens: bool
    return_num_output_tokens: bool
    lora_task_id: int | None
    lora_weights: np.ndarray[Any, Any] | None  # [1, N, W] FP16
    lora_config: np.ndarray[Any, Any] | None  # [1, N, 3] INT32
    outputs: frozenset[str]  # the outputs to send; every output when the request names none
    empty_final_response: bool  # the request's triton_enable_empty_final_response parameter


def metadata_json(model: str) -> dict[str, Any]:
    def tensors(specs: tuple[TensorSpec, ...]) -> list[dict[str, Any]]:
        return [{"name": s.name, "datatype": s.datatype, "shape": s.shape} for s in specs]

    return {
        "name": model,
        "versions": [VERSION],
        "platform": PLATFORM,
        "inputs": tensors(INPUTS),
        "outputs": tensors(OUTPUTS),
    }


def metadata_proto(model: str) -> service_pb2.ModelMetadataResponse:
    return json_format.ParseDict(metadata_json(model), service_pb2.ModelMetadataResponse())


def config_json(model: str) -> dict[str, Any]:
    def tensors(specs: tuple[TensorSpec, ...], with_optional: bool) -> list[dict[str, Any]]:
        out = []
        for s in specs:
            entry: dict[str, Any] = {
                "name": s.name,
                "data_type": _CONFIG_TYPES.get(s.datatype, f"TYPE_{s.datatype}"),
                "dims": list(s.dims),
            }
            if with_optional:
                entry["optional"] = s.optional
            out.append(entry)
        return out

    return {
        "name": model,
        "platform": "",
        "backend": PLATFORM,
        "max_batch_size": MAX_BATCH_SIZE,
        "input": tensors(INPUTS, with_optional=True),
        "output": tensors(OUTPUTS, with_optional=False),
        "model_transaction_policy": {"decoupled": True},
        "instance_group": [{"name": f"{model}_0", "kind": "KIND_CPU", "count": 1}],
        "parameters": {"accumulate_tokens": {"string_value": "false"}},
    }


def config_proto(model: str) -> model_config_pb2.ModelConfig:
    return json_format.ParseDict(config_json(model), model_config_pb2.ModelConfig())


def check_model(model: str, name: str, version: str) -> None:
    if name != model or version not in ("", VERSION):
        raise unknown_model(name, version)


def parse_request(model: str, request: service_pb2.ModelInferRequest) -> GenerateRequest:
    """Check a request against the contract as Triton's core does, then read its values."""
    check_model(model, request.model_name, request.model_version)
    prefix = f"[request id: {request.id or '<id_unknown>'}] "
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise TritonError(f"{prefix}expected {len(request.inputs)} raw input contents, got {len(raw)}")
    values: dict[str, np.ndarray[Any, Any]] = {}
    batch: int | None = None
    for index, tensor in enumerate(request.inputs):
        spec = _INPUTS.get(tensor.name)
        if spec is None:
            raise TritonError(f"{prefix}unexpected inference input '{tensor.name}' for model '{model}'")
        if tensor.datatype != spec.datatype:
            raise TritonError(
                f"{prefix}inference input '{tensor.name}' data-type is '{tensor.datatype}', but model '{model}' "
                f"expects '{spec.datatype}'"
            )
        shape = [int(d) for d in tensor.shape]
        fits = len(shape) == len(spec.shape) and all(
            want in (-1, got) for want, got in zip(spec.dims, shape[1:], strict=True)
        )
        if not fits:
            raise TritonError(
                f"{prefix}unexpected shape for input '{tensor.name}' for model '{model}'. Expected "
                f"{_dims(spec.shape)}, got {_dims(shape)}"
            )
        if shape[0] > MAX_BATCH_SIZE:
            raise TritonError(f"{prefix}inference request batch-size must be <= {MAX_BATCH_SIZE} for '{model}'")
        if batch is not None and shape[0] != batch:
            raise TritonError(f"{prefix}input '{tensor.name}' batch size does not match other inputs for '{model}'")
        batch = shape[0]
        values[tensor.name] = decode_input(tensor, raw[index] if raw else None)
    _check_required(model, prefix, values)
    if batch != 1:
        raise TritonError(f"{prefix}the simulated model serves a batch of 1 per request, got {batch}")
    for output in request.outputs:
        if output.name not in _OUTPUTS:
            raise TritonError(f"{prefix}unexpected inference output '{output.name}' for model '{model}'")
    return _read(request, values)


def _check_required(model: str, prefix: str, values: dict[str, np.ndarray[Any, Any]]) -> None:
    missing = [spec.name for spec in INPUTS if not spec.optional and spec.name not in values]
    if missing:
        required = sum(1 for spec in INPUTS if not spec.optional)
        raise TritonError(
            f"{prefix}expected number of inputs between {required} and {len(INPUTS)} but got {len(values)} inputs "
            f"for model '{model}'. Got input(s) {sorted(values)}, but missing required input(s) {missing}. Please "
            "provide all required input(s)."
        )


def _read(request: service_pb2.ModelInferRequest, values: dict[str, np.ndarray[Any, Any]]) -> GenerateRequest:
    empty_final = request.parameters.get("triton_enable_empty_final_response")
    return _values(
        values,
        request_id=request.id,
        outputs=frozenset(output.name for output in request.outputs),
        empty_final_response=empty_final is not None and empty_final.bool_param,
    )


def parse_json_request(model: str, body: object) -> GenerateRequest:
    """A generate extension request (``POST /v2/models/{model}/generate_stream``): a JSON object whose keys that name
    an input are that input's value (a scalar, or a flat list), batch of one; other keys are parameters. As Triton,
    FP16 cannot come as JSON (the LoRA weights travel over gRPC only)."""
    if not isinstance(body, dict):
        raise TritonError("failed to parse the request JSON buffer: the body is not an object", Kind.INTERNAL)
    values: dict[str, np.ndarray[Any, Any]] = {}
    for name, value in body.items():
        spec = _INPUTS.get(name)
        if spec is not None:
            values[name] = _json_input(spec, value)
    _check_required(model, "[request id: <id_unknown>] ", values)
    return _values(values, request_id=str(body.get("id", "")), outputs=frozenset(), empty_final_response=False)


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "BYTES": (str,), "BOOL": (bool,), "INT32": (int,), "UINT64": (int,), "FP32": (int, float),
}  # fmt: skip


def _json_input(spec: TensorSpec, value: object) -> np.ndarray[Any, Any]:
    if spec.datatype == "FP16":
        raise TritonError(
            f"receiving FP16 data via JSON is not supported. Please use the binary data format for input {spec.name}"
        )
    elements = value if isinstance(value, list) else [value]
    wanted = _JSON_TYPES[spec.datatype]
    for element in elements:  # bool is an int in Python, not in JSON
        if not isinstance(element, wanted) or (spec.datatype != "BOOL" and isinstance(element, bool)):
            raise TritonError(
                f"Unable to parse 'data': input '{spec.name}' expects {spec.datatype}, got {element!r}", Kind.INTERNAL
            )
    if spec.datatype == "BYTES":
        return np.array([[str(element).encode() for element in elements]], dtype=object)
    return np.array([elements])


def _values(
    values: dict[str, np.ndarray[Any, Any]], *, request_id: str, outputs: frozenset[str], empty_final_response: bool
) -> GenerateRequest:
    def scalar(name: str) -> Any:
        array = values.get(name)
        return None if array is None else array.reshape(-1)[0]

    def flag(name: str) -> bool:
        return bool(scalar(name))

    max_tokens = int(scalar("max_tokens"))
    if max_tokens <= 0:
        raise TritonError(f"max_tokens must be > 0 (got {max_tokens})")
    task_id = scalar("lora_task_id")
    return GenerateRequest(
        request_id=request_id,
        prompt=_text(scalar("text_input")),
        max_tokens=max_tokens,
        stop_words=tuple(_text(word).strip() for word in values.get("stop_words", np.empty(0)).reshape(-1)),
        stream=flag("stream"),
        exclude_input_in_output=flag("exclude_input_in_output"),
        return_num_input_tokens=flag("return_num_input_tokens"),
        return_num_output_tokens=flag("return_num_output_tokens"),
        lora_task_id=None if task_id is None else int(task_id),
        lora_weights=values.get("lora_weights"),
        lora_config=values.get("lora_config"),
        outputs=outputs,
        empty_final_response=empty_final_response,
    )


def _text(value: Any) -> str:
    return bytes(value).decode("utf-8", errors="replace")


def _dims(shape: list[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"
