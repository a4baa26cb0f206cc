"""A trace exporter the config names must be installed: check-config says so, before serve would exit on it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.config import EXPORTER_MODULES, load_config
from gateway.observe.telemetry import make_tracer_provider

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "deploy" / "examples" / "gateway.yaml"


def _with_exporter(tmp_path: Path, exporter: str) -> Path:
    path = tmp_path / "gateway.yaml"
    tracing = f"telemetry: {{tracing: {{exporter: {exporter}, otlp_endpoint: 'http://127.0.0.1:4318/v1/traces'}}}}\n"
    path.write_text(EXAMPLE.read_text() + tracing)
    return path


def test_otlp_passes_check_config_and_builds_its_exporter_when_installed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _with_exporter(tmp_path, "otlp")
    assert main(["check-config", str(path)]) == 0, capsys.readouterr().err
    provider = make_tracer_provider(load_config(path).telemetry.tracing)
    assert provider is not None
    provider.shutdown()


def test_check_config_fails_when_the_exporter_package_is_not_installed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module, _ = EXPORTER_MODULES["otlp"]
    monkeypatch.setitem(sys.modules, module, None)  # None in sys.modules: the import fails as if not installed
    assert main(["check-config", str(_with_exporter(tmp_path, "otlp"))]) == 1
    error = capsys.readouterr().err
    assert "telemetry.tracing.exporter" in error and "pip install 'tenantgate[otlp]'" in error, error
    assert main(["check-config", str(_with_exporter(tmp_path, "console"))]) == 0
