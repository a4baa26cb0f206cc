"""KServe v2 inference messages for the Triton driver, built and read straight from tritonclient's generated
protobufs: tritonclient's own InferInput/InferResult wrappers cost more CPU per request than the rest of the
driver (numpy round trips, an extra task per stream), and on the hot path that is the product's speed.

Inputs travel as raw bytes (``raw_input_contents``, one entry per input, in order), as tritonclient sends them:
fixed-size types little-endian, BYTES as each element's 4-byte little-endian length, then the element.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

Input = tuple[service_pb2.ModelInferRequest.InferInputTensor, bytes]
_LENGTH = struct.Struct("<I")
_INT32 = struct.Struct("<i")
_SCALAR_FORMATS = {"INT32": struct.Struct("<i"), "UINT64": struct.Struct("<Q"), "FP32": struct.Struct("<f")}


def _tensor(name: str, datatype: str, shape: Iterable[int]) -> service_pb2.ModelInferRequest.InferInputTensor:
    return service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=list(shape))


@functools.lru_cache(maxsize=4096)
def scalar(name: str, datatype: str, value: int | float | bool) -> Input:
    """A [1,1] input. Built once per value: flags, task ids and the common max_tokens repeat on most requests."""
    raw = (b"\x01" if value else b"\x00") if datatype == "BOOL" else _SCALAR_FORMATS[datatype].pack(value)
    return _tensor(name, datatype, (1, 1)), raw


def texts(name: str, values: list[bytes]) -> Input:
    """A [1,N] BYTES input."""
    raw = b"".join(_LENGTH.pack(len(value)) + value for value in values)
    return _tensor(name, "BYTES", (1, len(values))), raw


def array(name: str, datatype: str, values: np.ndarray[Any, Any]) -> Input:
    """An input from an array already in the datatype's layout (the converted LoRA weights and config)."""
    return _tensor(name, datatype, values.shape), values.tobytes()


def request(model: str, inputs: list[Input], outputs: tuple[str, ...]) -> service_pb2.ModelInferRequest:
    message = service_pb2.ModelInferRequest()
    message.CopyFrom(_request_head(model, outputs))  # one copy in C of what every request to the model repeats
    message.inputs.extend(tensor for tensor, _ in inputs)
    message.raw_input_contents.extend(raw for _, raw in inputs)
    return message


@functools.lru_cache(maxsize=256)
def _request_head(model: str, outputs: tuple[str, ...]) -> service_pb2.ModelInferRequest:
    """The model's name and the outputs asked for, built once per (model, outputs)."""
    message = service_pb2.ModelInferRequest(model_name=model)
    message.outputs.extend(service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=name) for name in outputs)
    return message


def output(response: service_pb2.ModelInferResponse, name: str) -> bytes | None:
    """An output's raw bytes, or None when the response does not carry it."""
    for index, tensor in enumerate(response.outputs):
        if tensor.name == name:
            return bytes(response.raw_output_contents[index]) if index < len(response.raw_output_contents) else None
    return None


def first_text(raw: bytes | None) -> str:
    """The first element of a BYTES output (the batch of one's text)."""
    if not raw or len(raw) < _LENGTH.size:
        return ""
    (length,) = _LENGTH.unpack_from(raw)
    return raw[_LENGTH.size : _LENGTH.size + length].decode("utf-8", errors="replace")


def first_int32(raw: bytes | None) -> int | None:
    """A token count from an INT32 output; a negative one (a broken model) is none, as over HTTP
    (backends/triton_http.py): it would reach the client's usage and give the tenant's token budget back."""
    if not raw or len(raw) < _INT32.size:
        return None
    (value,) = _INT32.unpack_from(raw)
    return int(value) if value >= 0 else None
