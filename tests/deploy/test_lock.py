"""The image runs what was tested: it installs requirements/gateway.lock, make test installs requirements/dev.lock,
and the two pin the same version of every package they share. No container engine runs here, so the Dockerfile's
build stage is run as written (its COPY and RUN steps, in order) into a fresh venv: it must succeed from the lock
alone and give a gateway that starts checking a config."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
IMAGE_EXTRAS = ("otlp",)  # what the Dockerfile installs the package with
DEV_EXTRAS = ("dev", "otlp", "loadtest")  # what make's venv installs


def pins(lock: str) -> dict[str, Version]:
    found = re.findall(r"^([A-Za-z0-9._-]+)==([^\s;]+)", (REPO / "requirements" / lock).read_text(), re.MULTILINE)
    return {str(canonicalize_name(name)): Version(version) for name, version in found}


def _requirements(extras: tuple[str, ...]) -> list[Requirement]:
    lines = PYPROJECT["dependencies"] + [r for e in extras for r in PYPROJECT["optional-dependencies"][e]]
    return [Requirement(line) for line in lines]


@pytest.mark.parametrize(("lock", "extras"), [("gateway.lock", IMAGE_EXTRAS), ("dev.lock", DEV_EXTRAS)])
def test_each_lock_pins_every_dependency_pyproject_names(lock: str, extras: tuple[str, ...]) -> None:
    """A dependency added to pyproject.toml without `make lock` fails here (the install would miss it)."""
    pinned = pins(lock)
    unmet = [
        str(r)
        for r in _requirements(extras)
        if not r.specifier.contains(pinned.get(str(canonicalize_name(r.name)), Version("0")))
    ]
    assert not unmet, f"{lock} does not pin a version these accept (run make lock): {unmet}"


def test_make_test_runs_the_versions_the_image_runs() -> None:
    image, dev = pins("gateway.lock"), pins("dev.lock")
    assert image and all(dev.get(name) == version for name, version in image.items()), {
        name: (version, dev.get(name)) for name, version in image.items() if dev.get(name) != version
    }
    makefile = (REPO / "Makefile").read_text()
    assert "pip install --quiet -r requirements/dev.lock" in makefile
    assert "pip install --quiet --no-deps -e" in makefile


def _build_stage(dockerfile: str) -> list[tuple[str, str]]:
    """The first stage's instructions, continuation lines joined: (instruction, arguments)."""
    joined = re.sub(r"\\\n\s*", " ", dockerfile)
    steps: list[tuple[str, str]] = []
    for line in joined.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        instruction, _, arguments = line.strip().partition(" ")
        if instruction == "FROM" and steps:
            break
        steps.append((instruction, arguments))
    return steps


def test_the_images_install_step_succeeds_from_the_lock_in_a_fresh_venv(tmp_path: Path) -> None:
    """deploy/Dockerfile's build stage, run here: /opt/tenantgate becomes a directory of the test's, `python` this
    interpreter, and pip may use its cache (the image's --no-cache-dir only keeps the layer small)."""
    prefix, workdir = tmp_path / "opt-tenantgate", tmp_path / "src"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    steps = _build_stage((REPO / "deploy" / "Dockerfile").read_text())
    assert [i for i, _ in steps][:2] == ["FROM", "WORKDIR"]
    for instruction, arguments in steps[2:]:
        if instruction == "COPY":
            *sources, destination = shlex.split(arguments)
            for source in sources:
                target = workdir / destination / (Path(source).name if destination.endswith("/") else "")
                target.parent.mkdir(parents=True, exist_ok=True)
                copy = shutil.copytree if (REPO / source).is_dir() else shutil.copy
                copy(REPO / source, target)
        elif instruction == "RUN":
            command = arguments.replace("/opt/tenantgate", str(prefix)).replace(" --no-cache-dir", "")
            done = subprocess.run(
                ["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True, timeout=900
            )
            assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        else:
            raise AssertionError(f"the test does not know {instruction} in the build stage")
    python = prefix / "bin" / "python"
    check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    freeze = subprocess.run([str(python), "-m", "pip", "freeze"], capture_output=True, text=True, timeout=120).stdout
    installed = {
        str(canonicalize_name(n)): Version(v) for n, v in re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", freeze, re.M)
    }
    assert all(installed.get(name) == version for name, version in pins("gateway.lock").items())
    version = subprocess.run(
        [str(prefix / "bin" / "tenantgate"), "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.stdout.strip() == f"tenantgate {PYPROJECT['version']}", version
    config = REPO / "deploy" / "examples" / "gateway.yaml"
    tracing = tmp_path / "gateway.yaml"  # with the otlp exporter, which the image's extra installs
    tracing.write_text(config.read_text() + "telemetry: {tracing: {exporter: otlp}}\n")
    checked = subprocess.run(
        [str(prefix / "bin" / "tenantgate"), "check-config", str(tracing)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stderr
