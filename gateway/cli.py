"""The ``tenantgate`` command. Subcommands import what they need lazily, so ``--help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.version import gateway_version

if TYPE_CHECKING:
    from gateway.config import GatewayConfig


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tenantgate",
        description="A multi-tenant LoRA gateway for LLM fleets.",
        epilog="Errors are one line; --debug shows the traceback. `tenantgate COMMAND --help` has examples.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    parser.add_argument("--version", action="version", version=f"tenantgate {gateway_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sim = commands.add_parser(
        "sim",
        help="run a simulated engine replica (vLLM or Triton protocol) for tests, load tests and the demo",
        description="Run one simulated engine replica that speaks vLLM's HTTP API (or, with --backend triton, "
        "Triton's KServe v2 gRPC and HTTP for a TensorRT-LLM model), with GPU adapter slots, a host-memory "
        "adapter cache, a prefix-cached KV cache and continuous batching. Delays follow the defaults in "
        "loadtests/sim/defaults.py.",
        epilog="Example: tenantgate sim --port 9001 --max-loras 2 --max-cpu-loras 4 "
        "--lora-modules support-acme=/srv/loras/support-acme --time-scale 0.1; "
        "tenantgate sim --backend triton --port 9101 --grpc-port 9102 --max-cpu-loras 8",
    )
    _sim_module().add_arguments(sim)
    sim.set_defaults(run=lambda args: _sim_module().run(args))
    serve = commands.add_parser(
        "serve", help="run the gateway",
        epilog="Example: TENANTGATE_ADMIN_TOKEN=... tenantgate serve --config /etc/tenantgate/gateway.yaml "
        "(SIGHUP reloads the config, SIGTERM drains and exits 0)",
    )  # fmt: skip
    serve.add_argument("--config", required=True, help="YAML config file")
    serve.add_argument(
        "--workers", type=int, default=1,
        help="gateway processes on the one port, under a supervisor that restarts them (default 1; above 1 needs "
        "state.redis_url)",
    )  # fmt: skip
    serve.add_argument("--worker-sockets", help=argparse.SUPPRESS)  # set by the supervisor (gateway/workers.py)
    serve.set_defaults(run=_serve)
    check = commands.add_parser(
        "check-config", help="validate a config file; print every error with its field path",
        epilog="Example: tenantgate check-config deploy/examples/gateway.yaml",
    )  # fmt: skip
    check.add_argument("file")
    check.add_argument(
        "--read-adapters", action="store_true",
        help="also read every adapter the gateway itself reads, as serving would (a Triton pool's: the gateway "
        "converts them and sends their weights)",
    )  # fmt: skip
    check.set_defaults(run=_check_config)
    hash_key = commands.add_parser(
        "hash-key", help="print the stored form (sha256:<hex>) of an API key read from stdin",
        epilog='Example: echo -n "$KEY" | tenantgate hash-key',
    )  # fmt: skip
    hash_key.set_defaults(run=_hash_key)
    plan = commands.add_parser(
        "plan",
        help="does a fleet plan fit in GPU (and host) memory, and what is the most it holds (arithmetic shown)",
        description="Example: tenantgate plan --gpu-memory-gib 80 --base-weights-gib 16 --hidden-size 4096 "
        "--layers 32 --adapter-rank 16 --target-modules 4 --working-set 16 --gpu-slots 4 "
        "--concurrent-sequences 64 --context-tokens 4096 --kv-heads 8 --head-dim 128 --replicas 4 "
        "--host-memory-gib 8",
    )
    for flag, kind, what in (
        ("--gpu-memory-gib", float, "GPU memory per replica"),
        ("--base-weights-gib", float, "the base model's weights"),
        ("--hidden-size", int, "the model's hidden size"),
        ("--layers", int, "transformer layers"),
        ("--adapter-rank", int, "LoRA rank"),
        ("--target-modules", int, "LoRA target modules per layer (q,k,v,o = 4)"),
        (
            "--working-set",
            int,
            "adapters cached per replica (max_adapters = the engine's --max-cpu-loras): host memory",
        ),
        ("--concurrent-sequences", int, "sequences in flight per replica at peak"),
        ("--context-tokens", int, "tokens per sequence (prompt + output)"),
        ("--kv-heads", int, "KV heads (grouped-query attention)"),
        ("--head-dim", int, "attention head dimension"),
    ):
        plan.add_argument(flag, type=kind, required=True, help=what)
    plan.add_argument(
        "--gpu-slots", type=int, default=1, help="the engine's GPU adapter slots (vLLM --max-loras; default 1)"
    )
    plan.add_argument("--host-memory-gib", type=float, help="host memory for the engine's adapter cache (checked)")
    plan.add_argument("--bytes-per-value", type=int, default=2, help="2 for fp16/bf16 (default), 1 for fp8")
    plan.add_argument("--headroom", type=float, default=0.1, help="share of GPU memory kept free (default 0.1)")
    plan.add_argument("--replicas", type=int, default=1, help="replicas in the pool (default 1)")
    plan.add_argument("--adapter-mib", type=float, help="a measured adapter size, instead of the rank arithmetic")
    plan.set_defaults(run=_plan)
    status = commands.add_parser(
        "status", help="print a running gateway's state: replicas, residency, tenants, adapters",
        epilog="Example: TENANTGATE_ADMIN_TOKEN=... tenantgate status --url http://127.0.0.1:8080",
    )  # fmt: skip
    status.add_argument("--url", required=True, help="the gateway's base URL")
    status.add_argument("--token-env", default="TENANTGATE_ADMIN_TOKEN", help="variable holding the admin token")
    status.set_defaults(run=_status)
    demo = commands.add_parser(
        "demo",
        help="start a simulated fleet, send real traffic through it and print what the routing did",
        epilog="Example: tenantgate demo   (about 15 s; no Redis, no GPU needed)",
    )
    demo.set_defaults(run=lambda args: _loadtests("demo").run())
    return parser


def _load_or_report(path: str) -> GatewayConfig | None:
    """The config at ``path``, or None after printing every problem with it to stderr."""
    from gateway.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return None


def _check_config(args: argparse.Namespace) -> int:
    config = _load_or_report(args.file)
    if config is None:
        return 1
    if args.read_adapters and not _adapters_readable(config):
        return 1
    replicas = sum(len(pool.replicas) for pool in config.pools)
    print(
        f"{args.file}: ok ({len(config.pools)} pools, {replicas} replicas, {len(config.adapters)} adapters, "
        f"{len(config.tenants)} tenants)"
    )
    return 0


def _adapters_readable(config: GatewayConfig) -> bool:
    """Whether every pool's engine can read its adapters, by the engine's own check (Triton: each converts to
    TensorRT-LLM's layout; vLLM reads its adapters itself, from its own disk: no check); prints each problem."""
    from backends.registry import spec
    from gateway.config import pool_adapters

    problems = []
    for pool in config.pools:
        read = spec(pool.backend).read_adapters
        if read is not None:
            problems += read(pool.name, pool.settings, pool_adapters(config, pool.name))
    for problem in problems:
        print(problem, file=sys.stderr)
    return not problems


def _hash_key(args: argparse.Namespace) -> int:
    from gateway.tenants.identity import hash_key

    key = sys.stdin.readline().strip()
    if not key:
        print("hash-key: give the API key on standard input", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def _serve(args: argparse.Namespace) -> int:
    import logging

    from gateway.config import ConfigError, load_config
    from gateway.observe import logs
    from gateway.server import serve

    # From the first line on, what serve writes is JSON lines, its refusals to start included.
    logs.configure()
    log = logging.getLogger("tenantgate")
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        log.error("invalid config %s: not serving", args.config, extra={"problems": exc.problems})
        return 1
    try:
        if args.worker_sockets is not None:
            from gateway.workers import WorkerSockets, follow_supervisor

            follow_supervisor()
            return serve(config, Path(args.config), worker=WorkerSockets.decode(args.worker_sockets))
        if args.workers != 1:
            from gateway.workers import supervise

            return supervise(config, Path(args.config), args.workers)
        return serve(config, Path(args.config))
    except ConfigError as exc:  # found at start, beyond the file: a weak admin token
        log.error("refusing to serve: %s", "; ".join(exc.problems), extra={"problems": exc.problems})
        return 1
    except Exception:
        if args.debug:
            raise
        log.exception("tenantgate serve failed")
        return 1


def _plan(args: argparse.Namespace) -> int:
    from gateway.plan import PlanInputs, compute

    try:
        inputs = PlanInputs(**{k: v for k, v in vars(args).items() if k not in ("command", "run", "debug")})
    except ValueError as exc:
        print(f"tenantgate plan: {exc}", file=sys.stderr)
        return 2
    result = compute(inputs)
    print("\n".join(result.lines))
    return 0 if result.fits else 1


def _status(args: argparse.Namespace) -> int:
    import os

    from gateway.admin.status_cli import fetch, render

    token = os.environ.get(args.token_env, "")
    if not token:
        raise SystemExit(f"tenantgate status: set {args.token_env} to the gateway's admin token")
    print(render(fetch(args.url, token)))
    return 0


def _loadtests(module: str) -> Any:
    # Only the CLI reaches into loadtests, and lazily: the gateway itself never imports the simulator.
    return importlib.import_module(f"loadtests.{module}")


def _sim_module() -> Any:
    return _loadtests("sim.cli")


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one clear line for the operator, unless they ask for the traceback
        if args.debug:
            raise
        print(f"tenantgate {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
