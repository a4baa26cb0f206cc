"""KServe v2 tensors on the wire: numpy arrays from a ``ModelInferRequest``'s inputs, response tensors from numpy.

tritonclient sends every input as raw bytes (``raw_input_contents``, one entry per input, in input order); a
BYTES tensor is its elements in row-major order, each a 4-byte little-endian length followed by the bytes.
Typed ``contents`` are read too, as Triton does for other clients. Fixed-size types are little-endian.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from loadtests.sim.triton_errors import TritonError

# KServe v2 datatypes the simulated model uses, with their numpy dtypes (BYTES elements are Python bytes).
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "UINT64": np.dtype("<u8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
}
# Which typed-contents field holds each datatype (FP16 has none: raw only).
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "BYTES": "bytes_contents",
}
_LENGTH = struct.Struct("<I")


def decode_input(tensor: service_pb2.ModelInferRequest.InferInputTensor, raw: bytes | None) -> np.ndarray[Any, Any]:
    """The input's values shaped as declared; ``raw`` is its entry in ``raw_input_contents``, if the client sent
    raw contents."""
    shape = tuple(int(d) for d in tensor.shape)
    count = math.prod(shape)
    if tensor.datatype == "BYTES":
        values = _split_bytes(tensor.name, raw, count) if raw is not None else list(tensor.contents.bytes_contents)
        if len(values) != count:
            raise TritonError(
                f"expected {count} string elements for inference input '{tensor.name}', got {len(values)}"
            )
        return np.array(values, dtype=np.object_).reshape(shape)
    dtype = NUMPY_DTYPES.get(tensor.datatype)
    if dtype is None:
        raise TritonError(f"inference input '{tensor.name}' has unsupported data-type '{tensor.datatype}'")
    if raw is not None:
        if len(raw) != count * dtype.itemsize:
            raise TritonError(
                f"input byte size mismatch for input '{tensor.name}'. Expected {count * dtype.itemsize}, got {len(raw)}"
            )
        return np.frombuffer(raw, dtype=dtype).reshape(shape)
    field = _CONTENTS_FIELD.get(tensor.datatype)
    typed = list(getattr(tensor.contents, field)) if field else []
    if len(typed) != count:
        raise TritonError(f"expected {count} elements for inference input '{tensor.name}', got {len(typed)}")
    return np.array(typed, dtype=dtype).reshape(shape)


def _split_bytes(name: str, raw: bytes, count: int) -> list[bytes]:
    values: list[bytes] = []
    offset = 0
    while offset < len(raw):
        if offset + _LENGTH.size > len(raw):
            raise TritonError(f"unexpected end of serialized BYTES tensor for inference input '{name}'")
        (length,) = _LENGTH.unpack_from(raw, offset)
        offset += _LENGTH.size
        if offset + length > len(raw):
            raise TritonError(f"unexpected end of serialized BYTES tensor for inference input '{name}'")
        values.append(raw[offset : offset + length])
        offset += length
    return values


def encode_bytes(values: list[bytes]) -> bytes:
    return b"".join(_LENGTH.pack(len(value)) + value for value in values)


def add_output(response: service_pb2.ModelInferResponse, name: str, datatype: str, value: bytes | int) -> None:
    """Append a ``[1,1]`` output tensor (the batch of one the model answers) as raw contents."""
    tensor = response.outputs.add()
    tensor.name, tensor.datatype = name, datatype
    tensor.shape.extend([1, 1])
    if datatype == "BYTES":
        assert isinstance(value, bytes)
        response.raw_output_contents.append(encode_bytes([value]))
    else:
        response.raw_output_contents.append(np.array([value], dtype=NUMPY_DTYPES[datatype]).tobytes())
