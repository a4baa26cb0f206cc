"""Deployment files, checked by tools since no cluster runs here: every kustomize overlay renders (kubectl) and
every object validates against the Kubernetes schemas (kubernetes-validate); the gateway configs they carry pass
`tenantgate check-config`; the Dockerfile passes hadolint and runs the command the README documents."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.config import parse_config

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = sorted(p.parent for p in (REPO / "deploy/k8s/overlays").glob("*/kustomization.yaml"))
KUBERNETES_VERSION = "1.32"


def render(overlay: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here (it is not in Debian's repositories): the render is skipped")
    rendered = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=True)
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_every_rendered_object_is_valid_kubernetes(overlay: Path) -> None:
    objects = render(overlay)
    kinds = {obj["kind"] for obj in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ConfigMap", "Secret"} <= kinds
    assert "StatefulSet" in kinds
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_the_config_in_the_configmap_passes_check_config(overlay: Path) -> None:
    [config_map] = [
        o for o in render(overlay) if o["kind"] == "ConfigMap" and "tenantgate-config" in o["metadata"]["name"]
    ]
    config = parse_config(config_map["data"]["gateway.yaml"], f"{overlay.name} ConfigMap")
    deployment = next(o for o in render(overlay) if o["kind"] == "Deployment" and o["metadata"]["name"] == "tenantgate")
    pod = deployment["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]  # the generator's hashed name is wired
    assert config.state.redis_url is not None
    # A Triton pool's adapters are read by the gateway itself (it sends the weights): they must be mounted there.
    [container] = pod["containers"]
    mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
    triton_pools = {p.name for p in config.pools if p.backend == "triton"}
    for adapter in config.adapters:
        if adapter.pool in triton_pools:
            assert any(adapter.source.startswith(path + "/") for path in mounts), (adapter.source, mounts)


def test_the_dockerfile_passes_hadolint_and_runs_the_documented_command() -> None:
    hadolint = Path(sys.executable).parent / "hadolint"
    dockerfile = REPO / "deploy/Dockerfile"
    result = subprocess.run([str(hadolint), str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    [entrypoint] = re.findall(r"^ENTRYPOINT (\[.*\])$", dockerfile.read_text(), re.MULTILINE)
    command = " ".join(json.loads(entrypoint))
    assert command == "tenantgate serve --config /etc/tenantgate/gateway.yaml"
    assert "tenantgate serve --config" in (REPO / "README.md").read_text()
    assert "USER 10001" in dockerfile.read_text()


def test_the_compose_file_and_its_gateway_config() -> None:
    compose = yaml.safe_load((REPO / "deploy/compose.yaml").read_text())
    assert {"gateway", "redis", "sim-0", "sim-1"} <= set(compose["services"])
    [mount] = compose["services"]["gateway"]["volumes"]
    config_file = (REPO / "deploy" / mount.split(":")[0]).resolve()
    config = parse_config(config_file.read_text(), str(config_file))
    assert {str(r.url).rstrip("/") for r in config.pools[0].replicas} == {"http://sim-0:8000", "http://sim-1:8000"}
