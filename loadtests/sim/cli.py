"""``tenantgate sim``: run one simulated engine replica in the foreground until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys

from aiohttp import web

from loadtests.sim.defaults import SimParams
from loadtests.sim.engine import SimEngine
from loadtests.sim.vllm_server import create_app

_DEFAULTS = SimParams()
_DEFAULT_MODEL = {"vllm": "tiny-llama", "triton": "tensorrt_llm_bls"}


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=["vllm", "triton"],
        default="vllm",
        help="protocol to speak: vllm (its OpenAI HTTP API) or triton (KServe v2 gRPC + HTTP, a TensorRT-LLM "
        "model with the LoRA contract of docs/triton.md) (default: vllm)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on (HTTP; with triton also /metrics)")
    parser.add_argument(
        "--grpc-port", type=int, help="triton only, required there: the gRPC port (Triton's 8001) for inference"
    )
    parser.add_argument(
        "--model",
        help=f"served model name (default: {_DEFAULT_MODEL['vllm']} with vllm, the base model; "
        f"{_DEFAULT_MODEL['triton']} with triton, the Triton model)",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=_DEFAULTS.max_loras,
        help=f"GPU adapter slots, as vLLM's flag (default: {_DEFAULTS.max_loras})",
    )
    parser.add_argument(
        "--max-cpu-loras",
        type=int,
        default=_DEFAULTS.max_cpu_loras,
        help="host-memory adapter cache, as vLLM's flag; with triton the PEFT cache's size in adapters "
        f"(default: {_DEFAULTS.max_cpu_loras})",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        default=_DEFAULTS.max_lora_rank,
        help=f"largest adapter rank accepted (default: {_DEFAULTS.max_lora_rank})",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=_DEFAULTS.max_num_seqs,
        help=f"continuous-batching seats (default: {_DEFAULTS.max_num_seqs})",
    )
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=_DEFAULTS.kv_blocks,
        help=f"KV cache capacity in blocks of {_DEFAULTS.block_size} tokens (default: {_DEFAULTS.kv_blocks})",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=_DEFAULTS.max_model_len,
        help=f"prompt + completion token limit (default: {_DEFAULTS.max_model_len})",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="*",
        type=_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="vllm only: adapters to load at start-up, as vLLM's flag",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=_DEFAULTS.time_scale,
        help="multiplies every simulated delay: 0.1 runs ten times faster, 0 never sleeps "
        f"(default: {_DEFAULTS.time_scale})",
    )
    parser.add_argument(
        "--seed", type=int, default=_DEFAULTS.seed, help=f"seeds answers and load jitter (default: {_DEFAULTS.seed})"
    )


def params_from(args: argparse.Namespace) -> SimParams:
    return dataclasses.replace(
        _DEFAULTS,
        max_loras=args.max_loras,
        max_cpu_loras=max(args.max_cpu_loras, args.max_loras),
        max_lora_rank=args.max_lora_rank,
        max_num_seqs=args.max_num_seqs,
        kv_blocks=args.kv_blocks,
        max_model_len=args.max_model_len,
        time_scale=args.time_scale,
        seed=args.seed,
    )


def _invalid(args: argparse.Namespace) -> str | None:
    """Why the flags do not fit together, or None."""
    if args.backend == "triton":
        if args.grpc_port is None:
            return "--grpc-port is required with --backend triton"
        if args.lora_modules:
            return (
                "--lora-modules is vLLM-only: a Triton/TensorRT-LLM engine reads no adapters, it gets LoRA weights "
                "with the requests that name their lora_task_id"
            )
    elif args.grpc_port is not None:
        return "--grpc-port is for --backend triton"
    return None


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _serve_vllm(args: argparse.Namespace, model: str) -> None:
    engine = SimEngine(params_from(args), model)
    app = create_app(engine, dict(args.lora_modules))
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the engine request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    print(f"sim (vllm) serving {model} on http://{args.host}:{args.port}", flush=True)
    await _until_signalled()
    await runner.cleanup()


async def _serve_triton(args: argparse.Namespace, model: str) -> None:
    # Imported here: the vLLM mode needs none of the gRPC stack.
    from loadtests.sim.triton_server import TritonSim, serving

    async with serving(TritonSim.build(params_from(args), model), args.host, args.port, args.grpc_port):
        print(
            f"sim (triton) serving model {model} on http://{args.host}:{args.port} (HTTP, /metrics) and "
            f"{args.host}:{args.grpc_port} (gRPC)",
            flush=True,
        )
        await _until_signalled()


def run(args: argparse.Namespace) -> int:
    problem = _invalid(args)
    if problem is not None:
        print(f"tenantgate sim: error: {problem}", file=sys.stderr)
        return 2
    model = args.model or _DEFAULT_MODEL[args.backend]
    asyncio.run(_serve_triton(args, model) if args.backend == "triton" else _serve_vllm(args, model))
    return 0
