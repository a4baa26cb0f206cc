"""What ships: the optional parts are extras of the package, and the image installs the ones it serves with."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from gateway.config import EXPORTER_MODULES
from gateway.observe.metrics import GatewayMetrics
from tests.servers import debian_tool

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_each_exporter_has_its_extra_and_the_image_installs_it() -> None:
    # The module an exporter needs comes from the distribution its extra lists (the import name's dots as dashes).
    for module, extra in EXPORTER_MODULES.values():
        distribution = "-".join(module.split(".")[:-1])
        assert distribution in _names(EXTRAS[extra]), (extra, EXTRAS[extra])
    dockerfile = (REPO / "deploy/Dockerfile").read_text()
    [install] = re.findall(r"pip install [^\n]*?(\"?\.\[[a-z,]+\]\"?)", dockerfile)
    installed = set(install.strip('"').removeprefix(".[").removesuffix("]").split(","))
    assert {extra for _, extra in EXPORTER_MODULES.values()} <= installed, install


def _third_party_imports(root: Path) -> dict[str, set[str]]:
    """Top-level modules imported by the files under ``root`` (function-level imports included), by module, with the
    files that import them; the standard library, ``__future__`` and this repository's packages left out."""
    local = {"gateway", "backends", "loadtests", "tests"}
    found: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local and top != "__future__":
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def _closure(requirements: list[str]) -> set[str]:
    """The distributions these requirements install, transitively (as installed here), normalised names."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        key = f"{name}[{','.join(sorted(requirement.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        for line in metadata.requires(requirement.name) or []:
            dependency = Requirement(line)
            environments = [{"extra": extra} for extra in requirement.extras] or [{"extra": ""}]
            if dependency.marker is None or any(dependency.marker.evaluate(env) for env in environments):
                todo.append(dependency)
    return {key.split("[")[0] for key in seen}


@pytest.mark.parametrize(
    ("tree", "extras"),
    [("gateway", []), ("backends", []), ("loadtests/sim", []), ("loadtests", ["loadtest"])],
)
def test_every_import_is_installed_by_the_dependencies_or_the_extra(tree: str, extras: list[str]) -> None:
    """A plain install runs the gateway; with tenantgate[loadtest], the demo, the load tests and the benchmarks.
    (The otlp exporter's module is imported only when configured, and the config checks it: see its own test.)"""
    installed = _closure(PYPROJECT["project"]["dependencies"] + [r for e in extras for r in EXTRAS[e]])
    providers = metadata.packages_distributions()
    optional = {module.split(".")[0] for module, _ in EXPORTER_MODULES.values()}
    missing = {
        module: sorted(files)
        for module, files in _third_party_imports(REPO / tree).items()
        if module not in optional and not {canonicalize_name(d) for d in providers.get(module, [])} & installed
    }
    assert not missing, f"imported but installed by no dependency of the package or the extra: {missing}"


def test_version_flag_and_build_info_metric_give_the_package_version() -> None:
    version = PYPROJECT["project"]["version"]
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == f"tenantgate {version}", result
    exposition = GatewayMetrics().exposition().decode()
    assert re.search(rf'^tenantgate_build_info\{{.*version="{re.escape(version)}".*\}} 1\.0$', exposition, re.MULTILINE)


def test_metrics_have_the_default_collectors_and_no_created_series() -> None:
    metrics = GatewayMetrics()
    metrics.requests.labels("t", "a", "p", "r", "200").inc()
    exposition = metrics.exposition().decode()
    for family in ("process_cpu_seconds_total", "process_resident_memory_bytes", "python_gc_collections_total"):
        assert f"\n{family}" in exposition, family
    assert "_created" not in exposition


def test_make_help_lists_every_target() -> None:
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):(?!=)", makefile, re.MULTILINE))
    listed = set(
        re.findall(
            r"^make ([a-z][a-z0-9-]*)",
            subprocess.check_output(["make", "-s", "help"], cwd=REPO, text=True),
            re.MULTILINE,
        )
    )
    assert targets and targets == listed, (targets - listed, listed - targets)


def test_the_alert_rules_pass_promtool() -> None:
    promtool = debian_tool("promtool", "promtool")
    rules = REPO / "deploy/observability/alerts.yaml"
    result = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
