"""predicted_ttft end to end: the openai SDK -> `tenantgate serve` (policy predicted_ttft) -> simulated vLLM
replicas. The gateway learns its TTFT lines from the streams it serves, exports them and their error, and
/admin/route shows each candidate's predicted TTFT with its parts."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.fleet import ADMIN_TOKEN, RunningFleet, api_key, fleet_with_gateway

pytestmark = pytest.mark.timeout(120)

TENANTS = {"acme": ["support-acme"], "globex": ["sql-globex"]}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PRIOR_WARM_S = 0.020  # the config default the model starts from (routing.ttft_priors.warm_ms)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    root = tmp_path_factory.mktemp("predicted")
    routing = {"affinity": "tenant", "ttft_learning_rate": 0.2, "load_scrape_interval_s": 0.2}
    with fleet_with_gateway(
        root, TENANTS, 3, ["--time-scale", "0.01"], policy="predicted_ttft", extra={"routing": routing}
    ) as fleet:
        yield fleet


def samples(fleet: RunningFleet, family: str) -> dict[tuple[str, ...], float]:
    text = httpx.get(fleet.gateway_url + "/metrics", headers=ADMIN, timeout=10).text
    found: dict[tuple[str, ...], float] = {}
    for metric in text_string_to_metric_families(text):
        for sample in metric.samples:
            if sample.name == family:
                found[tuple(f"{k}={v}" for k, v in sorted(sample.labels.items()))] = sample.value
    return found


def test_streams_teach_the_model_and_route_explains_each_candidate(fleet: RunningFleet) -> None:
    for tenant, (adapter,) in TENANTS.items():
        client = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key(tenant), max_retries=0, timeout=30)
        for turn in range(12):
            stream = client.completions.create(model=adapter, prompt=f"turn {turn}", max_tokens=4, stream=True)
            assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

    # One per stream, by the regime it was learned as; the gateway learns when the stream ends, which may be just
    # after the client has read its last chunk: poll (bounded).
    for _ in range(50):
        errors = samples(fleet, "tenantgate_ttft_prediction_error_seconds_count")
        if sum(errors.values()) == 24:
            break
        time.sleep(0.1)
    assert sum(errors.values()) == 24, errors
    model = samples(fleet, "tenantgate_ttft_model_seconds")
    warm = model[("pool=llama", "regime=warm", "term=base")]
    assert warm < PRIOR_WARM_S  # learned: at time scale 0.01 a warm TTFT is a few ms, not the prior's 20

    decision = httpx.get(fleet.gateway_url + "/admin/route?tenant=acme", headers=ADMIN, timeout=10).json()
    assert decision["policy"] == "predicted_ttft"
    predictions = decision["predictions"]
    assert set(predictions) == set(decision["candidates"]) == set(fleet.replica_urls)
    served_on = decision["chosen"]
    assert predictions[served_on]["regime"] == "warm"  # its adapter and prefix are warm where it was served
    for replica, predicted in predictions.items():
        assert set(predicted["parts"]) == {"queue", "regime", "affinity", "cold_stall"}
        assert predicted["total_ms"] == pytest.approx(sum(predicted["parts"].values()))
        assert predicted["parts"]["affinity"] == (0 if replica == decision["home"] else 10)
    assert min(predictions, key=lambda r: predictions[r]["total_ms"]) == served_on
