from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from gateway.cli import _build_parser
from loadtests.processes import free_port


def test_every_sim_flag_is_documented() -> None:
    subcommands = next(a for a in _build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    sim = subcommands.choices["sim"]
    flags = [action for action in sim._actions if action.option_strings and action.dest != "help"]
    assert {f.option_strings[0] for f in flags} >= {
        "--backend", "--host", "--port", "--model", "--max-loras", "--max-cpu-loras", "--max-num-seqs",
        "--lora-modules", "--time-scale", "--seed",
    }  # fmt: skip
    assert all(flag.help for flag in flags)


@pytest.mark.parametrize("command", ["serve", "check-config", "hash-key", "plan", "status", "sim", "demo"])
def test_every_subcommand_help_has_an_example(command: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "Example" in result.stdout, result.stdout


def test_an_error_is_one_line_and_debug_gives_the_traceback() -> None:
    """README, Status page: errors are one line (--debug for the traceback); here a gateway that is not there."""
    command = [sys.executable, "-m", "gateway.cli", "status", "--url", f"http://127.0.0.1:{free_port()}"]
    env = {**os.environ, "TENANTGATE_ADMIN_TOKEN": "t" * 40}
    plain = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert plain.returncode == 1 and plain.stderr.startswith("tenantgate status: "), plain.stderr
    assert len(plain.stderr.strip().splitlines()) == 1 and "Traceback" not in plain.stderr, plain.stderr
    debug = subprocess.run([*command[:3], "--debug", *command[3:]], capture_output=True, text=True, timeout=60, env=env)
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr, debug.stderr
