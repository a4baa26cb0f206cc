"""Deployment files, checked by tools since no cluster runs here: every kustomize overlay renders (kubectl) and
every object validates against the Kubernetes schemas (kubernetes-validate); the gateway configs they carry pass
`tenantgate check-config`; the Dockerfile passes hadolint and runs the command the README documents."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from aiohttp import web

from gateway.admin.operator import add_routes
from gateway.config import parse_config

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = sorted(p.parent for p in (REPO / "deploy/k8s/overlays").glob("*/kustomization.yaml"))
KUBERNETES_VERSION = "1.32"


def render(overlay: Path, **wrapper: Any) -> list[dict[str, Any]]:
    """The overlay rendered by `kubectl kustomize`; with ``wrapper`` (kustomization fields such as ``namespace``
    or ``images``), rendered as an operator's own kustomization that names it as a resource would render it."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here (it is not in Debian's repositories): the render is skipped")
    with tempfile.TemporaryDirectory() as root:
        if wrapper:  # kustomize takes a base by relative path only
            kustomization = {"resources": [os.path.relpath(overlay, root)], **wrapper}
            (Path(root) / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
            overlay = Path(root)
        rendered = subprocess.run([kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=True)
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_every_rendered_object_is_valid_kubernetes(overlay: Path) -> None:
    objects = render(overlay)
    kinds = {obj["kind"] for obj in objects}
    assert {
        "Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ConfigMap",
        "PersistentVolumeClaim", "NetworkPolicy",
    } <= kinds  # fmt: skip
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


def operator_secrets() -> set[str]:
    """The Secrets the runbook tells the operator to create (docs/operations.md, "Secrets the operator creates")."""
    runbook = (REPO / "docs/operations.md").read_text()
    section = runbook.split("### Secrets the operator creates", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^- `([a-z0-9.-]+)`", section, re.MULTILINE))


def _pods(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(o["metadata"]["name"], o["spec"]["template"]["spec"]) for o in objects if "template" in o.get("spec", {})]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_every_referenced_volume_config_map_and_secret_is_defined(overlay: Path) -> None:
    objects = render(overlay)
    defined: dict[str, dict[str, set[str]]] = {"ConfigMap": {}, "Secret": {}, "PersistentVolumeClaim": {}}
    for obj in objects:
        if obj["kind"] in defined:
            defined[obj["kind"]][obj["metadata"]["name"]] = set(obj.get("data", {}))
    operator = operator_secrets()

    def check(kind: str, name: str, key: str | None, where: str) -> None:
        if kind == "Secret" and name in operator:
            return  # the operator creates it before applying (the runbook lists it)
        assert name in defined[kind], f"{where} references {kind} {name!r}, which the overlay does not define"
        assert key is None or key in defined[kind][name], f"{where}: {kind} {name!r} has no key {key!r}"

    for owner, pod in _pods(objects):
        claims: set[str] = set()  # volumeClaimTemplates would define claims of their own: none here
        for volume in pod.get("volumes", []):
            where = f"{owner} volume {volume['name']}"
            if "persistentVolumeClaim" in volume and volume["persistentVolumeClaim"]["claimName"] not in claims:
                check("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"], None, where)
            if "configMap" in volume:
                check("ConfigMap", volume["configMap"]["name"], None, where)
            if "secret" in volume:
                check("Secret", volume["secret"]["secretName"], None, where)
        for container in pod["containers"] + pod.get("initContainers", []):
            mounted = {m["name"] for m in container.get("volumeMounts", [])}
            assert mounted <= {v["name"] for v in pod.get("volumes", [])}, (owner, mounted)
            for env in container.get("env", []):
                source = env.get("valueFrom", {})
                if "secretKeyRef" in source:
                    check("Secret", source["secretKeyRef"]["name"], source["secretKeyRef"]["key"], owner)
                if "configMapKeyRef" in source:
                    check("ConfigMap", source["configMapKeyRef"]["name"], source["configMapKeyRef"]["key"], owner)
            for env_from in container.get("envFrom", []):
                if "secretRef" in env_from:
                    check("Secret", env_from["secretRef"]["name"], None, owner)
                if "configMapRef" in env_from:
                    check("ConfigMap", env_from["configMapRef"]["name"], None, owner)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_volume_claims_name_the_documented_storage_class_placeholder(overlay: Path) -> None:
    claims = [o for o in render(overlay) if o["kind"] == "PersistentVolumeClaim"]
    assert {c["metadata"]["name"] for c in claims} >= {"models", "loras"}
    runbook = (REPO / "docs/operations.md").read_text()
    for claim in claims:
        storage_class = claim["spec"]["storageClassName"]
        assert f"`{storage_class}`" in runbook, f"{storage_class} is not documented in docs/operations.md"
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every engine replica mounts it at once


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_the_namespace_is_the_one_kustomize_sets_everywhere(overlay: Path) -> None:
    objects = render(overlay, namespace="tenants-test")
    cluster_scoped: set[str] = set()  # none of ours: every object lives in the namespace
    for obj in objects:
        assert obj["kind"] in cluster_scoped or obj["metadata"].get("namespace") == "tenants-test", obj["metadata"]
    # The transformer does not rewrite names inside config data: the gateway's config must name no namespace.
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap" and "tenantgate-config" in o["metadata"]["name"]]
    config = parse_config(config_map["data"]["gateway.yaml"])
    for pool in config.pools:
        if pool.discovery is not None:
            name = pool.discovery.name
            assert not name.endswith(".") and "svc" not in name.split("."), f"{name} is not relative to the namespace"
    assert config.state.redis_url is not None
    assert "." not in config.state.redis_url.split("//", 1)[1].split(":", 1)[0]  # the Service's short name
    # What it names must exist in that namespace: the discovery Service and the Redis Service.
    services = {o["metadata"]["name"] for o in objects if o["kind"] == "Service"}
    for pool in config.pools:
        if pool.discovery is not None:
            assert pool.discovery.name.split(".")[-1] in services, (pool.discovery.name, services)
    assert config.state.redis_url.split("//", 1)[1].split(":", 1)[0] in services


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_the_image_is_set_the_kustomize_way(overlay: Path) -> None:
    def gateway_image(objects: list[dict[str, Any]]) -> str:
        [image] = [str(c["image"]) for name, pod in _pods(objects) if name == "tenantgate" for c in pod["containers"]]
        return image

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert gateway_image(render(overlay)) == f"tenantgate:{version}"
    images = [{"name": "tenantgate", "newName": "registry.test/team/tenantgate", "newTag": "1.2.3"}]
    assert gateway_image(render(overlay, images=images)) == "registry.test/team/tenantgate:1.2.3"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_the_autoscaler_alone_sets_the_replica_count(overlay: Path) -> None:
    objects = render(overlay)
    for hpa in (o for o in objects if o["kind"] == "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        [scaled] = [o for o in objects if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        assert "replicas" not in scaled["spec"], "an applied `replicas` resets what the autoscaler chose"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_shutdown_outlasts_endpoint_removal_and_the_grace_period_outlasts_shutdown(overlay: Path) -> None:
    objects = render(overlay)
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap" and "tenantgate-config" in o["metadata"]["name"]]
    shutdown = parse_config(config_map["data"]["gateway.yaml"]).shutdown
    [(_, pod)] = [(name, pod) for name, pod in _pods(objects) if name == "tenantgate"]
    [container] = pod["containers"]
    probe = container["readinessProbe"]
    pre_stop_s = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    # Endpoint removal starts with SIGTERM; a load balancer that follows only the readiness probe notices after
    # period x failureThreshold. Until then the gateway must still accept (drain_delay_s, or a preStop sleep).
    assert pre_stop_s + shutdown.drain_delay_s > probe["periodSeconds"] * probe["failureThreshold"]
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= pre_stop_s + shutdown.drain_delay_s + shutdown.drain_timeout_s + 5


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_prometheus_is_told_where_to_scrape_the_gateway(overlay: Path) -> None:
    objects = render(overlay)
    [deployment] = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "tenantgate"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    port = int(annotations["prometheus.io/port"])
    assert port in {p["containerPort"] for p in container["ports"]}
    # The operator listener, where /metrics needs no token (a scrape that follows annotations sends none), and
    # never the tenant port, where it would need one (gateway/admin/operator.py).
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap" and "tenantgate-config" in o["metadata"]["name"]]
    config = parse_config(config_map["data"]["gateway.yaml"])
    assert config.admin.listen is not None and config.admin.listen.host == "0.0.0.0"
    assert port == config.admin.listen.port != config.listen.port
    app = web.Application()
    add_routes(app)
    served = {r.canonical for r in app.router.resources()}
    assert annotations["prometheus.io/path"] in served
    # The Service (what tenants reach) leaves the operator port out.
    named = {p.get("name"): p["containerPort"] for p in container["ports"]}
    for service in (o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "tenantgate"):
        targets = {named.get(p["targetPort"], p["targetPort"]) for p in service["spec"]["ports"]}
        assert port not in targets and config.listen.port in targets


def _labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # matchExpressions: not used here
    return all(labels.get(key) == value for key, value in selector.get("matchLabels", {}).items())


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_redis_takes_tls_a_client_certificate_and_a_password_and_admits_only_the_gateways(overlay: Path) -> None:
    """Redis decides who is a tenant: the rendered Redis has no plain port, asks for a client certificate and a
    password from a Secret; the gateway's config reaches it by rediss:// with files mounted from Secrets (no
    password in the config); one NetworkPolicy admits the gateway pods alone, on the Redis port."""
    objects = render(overlay)
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap" and "tenantgate-config" in o["metadata"]["name"]]
    state = parse_config(config_map["data"]["gateway.yaml"]).state
    assert state.redis_url is not None and state.redis_url.startswith("rediss://")  # was redis://, no password
    assert state.password_file is not None and state.tls is not None
    assert state.tls.ca_file and state.tls.cert_file and state.tls.key_file
    pods = dict(_pods(objects))
    gateway, redis = pods["tenantgate"], pods["tenantgate-redis"]
    # Every file the config names is in a volume mounted from a Secret.
    [container] = gateway["containers"]
    secret_volumes = {v["name"]: v["secret"] for v in gateway["volumes"] if "secret" in v}
    for path in (state.password_file, state.tls.ca_file, state.tls.cert_file, state.tls.key_file):
        directory, _, name = path.rpartition("/")
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
        volume = secret_volumes[mount["name"]]
        assert volume["secretName"] in operator_secrets()
        assert name in [item["path"] for item in volume.get("items", [])] or "items" not in volume
    [server] = redis["containers"]
    args = server["args"]

    def arg(flag: str) -> str:
        return str(args[args.index(flag) + 1])

    assert arg("--port") == "0" and arg("--tls-auth-clients") == "yes"
    assert int(arg("--tls-port")) == server["ports"][0]["containerPort"]
    [password_env] = [e for e in server["env"] if arg("--requirepass") == f"$({e['name']})"]
    assert password_env["valueFrom"]["secretKeyRef"]["name"] in operator_secrets()
    # The NetworkPolicy: Redis' pods, ingress only, from the gateway's pods only, on the Redis port only.
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    redis_labels = deployments["tenantgate-redis"]["spec"]["template"]["metadata"]["labels"]
    gateway_labels = deployments["tenantgate"]["spec"]["template"]["metadata"]["labels"]
    policies = [
        o for o in objects if o["kind"] == "NetworkPolicy" and _labels_match(o["spec"]["podSelector"], redis_labels)
    ]
    assert len(policies) == 1, "no NetworkPolicy selects Redis' pods: anything in the cluster can reach it"
    spec = policies[0]["spec"]
    assert "Ingress" in spec["policyTypes"]
    [rule] = spec["ingress"]
    [source] = rule["from"]
    assert set(source) == {"podSelector"}  # no namespaceSelector, no ipBlock: this namespace's pods only
    assert _labels_match(source["podSelector"], gateway_labels)
    assert not _labels_match(source["podSelector"], redis_labels)
    for workload in (o for o in objects if "template" in o.get("spec", {})):  # no other pods carry those labels
        if workload["metadata"]["name"] != "tenantgate":
            labels = workload["spec"]["template"]["metadata"]["labels"]
            assert not _labels_match(source["podSelector"], labels), workload["metadata"]["name"]
    assert [p["port"] for p in rule["ports"]] in (["redis"], [6379])


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_the_figures_the_runbook_gives_for_the_overlays(overlay: Path) -> None:
    """docs/operations.md, Kubernetes: the autoscaler keeps 2 to 10 gateways, the operator listener is 0.0.0.0:9090
    beside the tenant port 8080 (the Service's only port), SIGTERM keeps accepting for drain_delay_s 5 then drains
    for up to drain_timeout_s 30 within a 45 s grace period."""
    objects = render(overlay)
    [hpa] = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap" and "tenantgate-config" in o["metadata"]["name"]]
    config = parse_config(config_map["data"]["gateway.yaml"])
    assert config.admin.listen is not None
    assert (config.admin.listen.host, config.admin.listen.port, config.listen.port) == ("0.0.0.0", 9090, 8080)
    assert (config.shutdown.drain_delay_s, config.shutdown.drain_timeout_s) == (5, 30)
    [(_, pod)] = [(name, pod) for name, pod in _pods(objects) if name == "tenantgate"]
    assert pod["terminationGracePeriodSeconds"] == 45
    [service] = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "tenantgate"]
    assert len(service["spec"]["ports"]) == 1
