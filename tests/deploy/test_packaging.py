"""What ships: the optional parts are extras of the package, and the image installs the ones it serves with."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from gateway.config import EXPORTER_MODULES

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
