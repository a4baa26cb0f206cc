"""The ceiling on what one request is charged (gateway/tenants/admission.py, clamp_usage), on plain data; end to
end, an engine's absurd report is tests/gateway/tenants/test_admission_e2e.py's."""

from __future__ import annotations

import pytest

from gateway.observe.metrics import GatewayMetrics
from gateway.observe.telemetry import RequestRecord
from gateway.tenants.admission import PROMPT_OVERHEAD_TOKENS, clamp_usage, completion_ceiling, prompt_ceiling


@pytest.mark.parametrize(
    ("body_bytes", "text_only", "context", "expected"),
    [
        pytest.param(100, True, 1_000_000, 100 + PROMPT_OVERHEAD_TOKENS, id="text: its bytes and a template's"),
        pytest.param(100_000, True, 8192, 8192, id="text: never above the context"),
        pytest.param(100, False, 8192, 8192, id="images and other parts: the context"),
    ],
)
def test_the_prompt_ceiling(body_bytes: int, text_only: bool, context: int, expected: int) -> None:
    assert prompt_ceiling(body_bytes, text_only, context) == expected


@pytest.mark.parametrize(
    ("max_tokens", "choices", "context", "expected"),
    [
        pytest.param(16, 1, 8192, 16, id="max_tokens"),
        pytest.param(16, 3, 8192, 48, id="for each choice"),
        pytest.param(None, 2, 8192, 2 * 8192, id="none: the context"),
        pytest.param(10**9, 1, 8192, 8192, id="never above the context"),
    ],
)
def test_the_completion_ceiling(max_tokens: int | None, choices: int, context: int, expected: int) -> None:
    assert completion_ceiling(max_tokens, choices, context) == expected


def clamped(metrics: GatewayMetrics) -> float:
    value = metrics.registry.get_sample_value("tenantgate_usage_clamped_total", {"pool": "p", "replica": "r0"})
    return value or 0.0


@pytest.mark.parametrize(
    ("reported", "charged", "recorded", "counted"),
    [
        pytest.param((10, 5), 15, (10, 5), 0, id="within: as reported"),
        pytest.param((10, 10**15 - 1), 10 + 16, (10, 16), 1, id="completion over"),
        pytest.param((10**12, 5), 100 + 5, (100, 5), 1, id="prompt over"),
        pytest.param((None, 5), None, (None, 5), 0, id="half a report: nothing charged"),
        pytest.param((None, 10**12), None, (None, 16), 1, id="half a report over: its counter clamped"),
    ],
)
def test_a_report_over_the_ceiling_is_charged_at_it_and_counted(
    reported: tuple[int | None, int | None],
    charged: int | None,
    recorded: tuple[int | None, int | None],
    counted: float,
) -> None:
    metrics = GatewayMetrics()
    record = RequestRecord("/v1/completions", pool="p", replica="r0")
    record.prompt_tokens, record.completion_tokens = reported
    assert clamp_usage(record, metrics, 100, 16) == charged
    assert (record.prompt_tokens, record.completion_tokens) == recorded
    assert clamped(metrics) == counted
