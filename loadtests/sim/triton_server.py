"""A simulated Triton Inference Server replica serving one TensorRT-LLM model (docs/triton.md's contract): the
same engine as vLLM mode behind a PEFT cache, spoken to over KServe v2 gRPC (inference) and HTTP (health,
metadata, metrics).

Parts: triton_contract (the model's I/O), triton_wire (tensors), peft_cache (LoRA tasks), triton_model (requests
through the engine), triton_grpc and triton_http (the two protocols), triton_metrics (``/metrics``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from aiohttp import web

from loadtests.sim.defaults import SimParams
from loadtests.sim.engine import SimEngine
from loadtests.sim.faults import Faults
from loadtests.sim.peft_cache import PeftCache
from loadtests.sim.triton_grpc import TritonGrpcService, create_server
from loadtests.sim.triton_http import create_app
from loadtests.sim.triton_model import TrtLlmModel


@dataclass
class TritonSim:
    model_name: str
    model: TrtLlmModel
    faults: Faults

    @classmethod
    def build(cls, params: SimParams, model_name: str) -> TritonSim:
        engine = SimEngine(params, model_name)
        # The PEFT cache is the host tier (--max-cpu-loras tasks); the engine keeps modelling the GPU slots.
        peft = PeftCache(params.max_cpu_loras, params.max_lora_rank, engine.adapters)
        return cls(model_name, TrtLlmModel(engine, peft), Faults())

    def http_app(self) -> web.Application:
        """The HTTP endpoint; it also runs the engine's step loop, so start it before serving gRPC."""
        return create_app(self.model, self.faults, self.model_name)

    def grpc_server(self, address: str) -> grpc.aio.Server:
        return create_server(TritonGrpcService(self.model, self.faults, self.model_name), address)


@contextlib.asynccontextmanager
async def serving(sim: TritonSim, host: str, http_port: int, grpc_port: int) -> AsyncIterator[None]:
    """Both endpoints listening until the block ends."""
    # handler_cancellation: a client that disconnects cancels its handler, as in vLLM mode.
    runner = web.AppRunner(sim.http_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    server = sim.grpc_server(f"{host}:{grpc_port}")
    try:
        await server.start()
        await web.TCPSite(runner, host, http_port).start()
        yield
    finally:
        await server.stop(grace=1.0)
        await runner.cleanup()
