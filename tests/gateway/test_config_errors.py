"""check-config reports every problem in one run, each at the path of the field that is wrong: cross-references
(unknown pools, adapters, models; duplicate names) included, and not hidden by an error in another field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.cli import main
from gateway.config import ConfigError, parse_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((REPO / "deploy" / "examples" / "gateway.yaml").read_text())
KEY = "sha256:" + "1" * 64


def _broken(**changes: object) -> str:
    config = {**EXAMPLE, **changes}
    return yaml.safe_dump(config)


ACME, GLOBEX = EXAMPLE["tenants"]
SUPPORT, SQL = EXAMPLE["adapters"]
POOL = EXAMPLE["pools"][0]


@pytest.mark.parametrize(
    ("changes", "path", "message"),
    [
        pytest.param({"adapters": [SUPPORT, {**SQL, "pool": "nope"}]}, "adapters.1.pool", "names unknown pool 'nope'",
                     id="unknown-pool"),
        pytest.param({"tenants": [ACME, {**GLOBEX, "adapters": ["sql-initech"]}]}, "tenants.1.adapters.0",
                     "names unknown adapter 'sql-initech'", id="unknown-adapter"),
        pytest.param({"tenants": [ACME, {**GLOBEX, "base_models": ["gpt"]}]}, "tenants.1.base_models.0",
                     "names unknown base model 'gpt'", id="unknown-base-model"),
        pytest.param({"tenants": [ACME, {**GLOBEX, "id": "acme"}]}, "tenants.1.id",
                     "duplicate tenant id 'acme' (first at tenants.0.id)", id="duplicate-tenant"),
        pytest.param({"tenants": [ACME, {**GLOBEX, "api_keys": ACME["api_keys"]}]}, "tenants.1.api_keys.0",
                     "duplicate api key", id="duplicate-key"),
        pytest.param({"adapters": [SUPPORT, {**SQL, "name": "support-acme"}]}, "adapters.1.name",
                     "duplicate adapter name", id="duplicate-adapter"),
        pytest.param({"pools": [POOL, {**POOL, "base_model": "other"}]}, "pools.1.name", "duplicate pool name",
                     id="duplicate-pool"),
        pytest.param({"adapters": [SUPPORT, {**SQL, "name": "tiny-llama"}]}, "adapters.1.name",
                     "must differ from base model names", id="adapter-named-like-base"),
        pytest.param({"adapters": [SUPPORT, {**SQL, "engine_name": "support-acme"}]}, "adapters.1.engine_name",
                     "another adapter's name", id="engine-name-borrowed"),
        pytest.param({"adapters": [{**SUPPORT, "pinned": True}, {**SQL, "pinned": True}],
                      "pools": [{**POOL, "max_adapters": 1}]}, "pools.0.max_adapters", "pins 2 adapters",
                     id="pinned-over-max"),
        pytest.param({"splits": [{"name": "support", "variants": [{"model": "nope", "weight": 1}]}]},
                     "splits.0.variants.0.model", "unknown model 'nope'", id="split-unknown-model"),
    ],
)  # fmt: skip
def test_each_cross_reference_error_names_its_field(changes: dict[str, object], path: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(_broken(**changes))
    assert any(p.startswith(f"{path}: ") and message in p for p in caught.value.problems), caught.value.problems
    assert not any("(top level)" in p for p in caught.value.problems), caught.value.problems


def test_check_config_prints_field_errors_and_cross_reference_errors_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _broken(
        routing={**EXAMPLE["routing"], "vnodes": 0},  # a field error...
        adapters=[SUPPORT, {**SQL, "pool": "nope"}],  # ...and three cross-references, one a duplicate
        tenants=[ACME, {**GLOBEX, "adapters": ["sql-initech"]}, {**GLOBEX, "api_keys": [KEY]}],
    )
    path = tmp_path / "gateway.yaml"
    path.write_text(config)
    assert main(["check-config", str(path)]) == 1
    lines = capsys.readouterr().err.splitlines()[1:]
    located = sorted(line.strip().split(":", 1)[0] for line in lines)
    assert located == ["adapters.1.pool", "routing.vnodes", "tenants.1.adapters.0", "tenants.2.id"], lines
