"""The ``tenantgate`` command. Subcommands import what they need lazily, so ``--help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tenantgate", description="A multi-tenant LoRA gateway for LLM fleets.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sim = commands.add_parser(
        "sim",
        help="run a simulated engine replica (vLLM protocol) for tests, load tests and the demo",
        description="Run one simulated engine replica that speaks vLLM's HTTP API, with GPU adapter slots, a "
        "host-memory adapter cache, a prefix-cached KV cache and continuous batching. Delays follow the "
        "defaults in loadtests/sim/defaults.py.",
    )
    _sim_module().add_arguments(sim)
    sim.set_defaults(run=lambda args: _sim_module().run(args))
    demo = commands.add_parser(
        "demo", help="start a simulated fleet, send real traffic through it and print what the routing did"
    )
    demo.set_defaults(run=lambda args: _loadtests("demo").run())
    return parser


def _loadtests(module: str) -> Any:
    # Only the CLI reaches into loadtests, and lazily: the gateway itself never imports the simulator.
    return importlib.import_module(f"loadtests.{module}")


def _sim_module() -> Any:
    return _loadtests("sim.cli")


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
