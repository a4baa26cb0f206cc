"""``tenantgate sim``: run one simulated engine replica in the foreground until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal

from aiohttp import web

from loadtests.sim.defaults import SimParams
from loadtests.sim.engine import SimEngine
from loadtests.sim.vllm_server import create_app

_DEFAULTS = SimParams()


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=["vllm"], default="vllm", help="protocol to speak (default: vllm)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    parser.add_argument("--model", default="tiny-llama", help="served base model name (default: tiny-llama)")
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
        help=f"host-memory adapter cache, as vLLM's flag (default: {_DEFAULTS.max_cpu_loras})",
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
        help="adapters to load at start-up, as vLLM's flag",
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


async def _serve(args: argparse.Namespace) -> None:
    engine = SimEngine(params_from(args), args.model)
    app = create_app(engine, dict(args.lora_modules))
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the engine request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    print(f"sim ({args.backend}) serving {args.model} on http://{args.host}:{args.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    asyncio.run(_serve(args))
    return 0
