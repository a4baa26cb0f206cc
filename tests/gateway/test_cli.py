from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from gateway.cli import _build_parser


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
