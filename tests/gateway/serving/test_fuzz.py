"""Fuzzing the tenant endpoints: requests generated from the gateway's own OpenAPI description (/openapi.json),
arbitrary JSON, and raw junk, 2,000 per endpoint, against a gateway process in front of a simulated replica.
Whatever comes: no 5xx, no crash, every error an OpenAI-style body, and a well-formed request works after."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadtests.fleet import RunningFleet, api_key, fleet_with_gateway
from tests.schema_strategies import from_schema

pytestmark = pytest.mark.timeout(600)

TENANTS = {"acme": ["support-acme"], "globex": ["sql-globex"]}
MODELS = st.sampled_from(["support-acme", "sql-globex", "tiny-llama", "nope", ""])
HEADERS = {"Authorization": f"Bearer {api_key('acme')}", "Content-Type": "application/json"}
SETTINGS = settings(
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    database=None,
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    root = tmp_path_factory.mktemp("fuzz")
    sim = ["--time-scale", "0", "--max-loras", "4", "--max-model-len", "256"]
    with fleet_with_gateway(root, TENANTS, 1, sim, extra={"telemetry": {"access_log": False}}) as running:
        yield running


@pytest.fixture(scope="module")
def spec(fleet: RunningFleet) -> dict[str, Any]:
    document: dict[str, Any] = httpx.get(fleet.gateway_url + "/openapi.json").json()
    return document


def bodies(spec: dict[str, Any], schema: str) -> st.SearchStrategy[bytes]:
    """Valid-shaped requests (from the OpenAPI schema, some fields swapped for odd values), any JSON, raw bytes."""
    shaped = from_schema(spec["components"]["schemas"][schema], spec).flatmap(
        lambda body: st.fixed_dictionaries({"model": MODELS}).map(lambda model: {**body, **model})
    )
    mutated = st.tuples(shaped, st.text(max_size=16), JSON).map(lambda t: {**t[0], t[1]: t[2]})
    as_json = st.one_of(shaped, mutated, JSON).map(lambda value: json.dumps(value).encode())
    return st.one_of(as_json, st.binary(max_size=200))


STATUSES: dict[int, int] = {}


def check(client: httpx.Client, path: str, body: bytes) -> None:
    response = client.post(path, content=body)
    STATUSES[response.status_code] = STATUSES.get(response.status_code, 0) + 1
    assert response.status_code < 500, (response.status_code, body[:300], response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, response.text


@pytest.mark.parametrize(("path", "schema"), [("/v1/completions", "Completion"), ("/v1/chat/completions", "Chat")])
def test_generated_requests_never_get_a_5xx(fleet: RunningFleet, spec: dict[str, Any], path: str, schema: str) -> None:
    STATUSES.clear()
    with httpx.Client(base_url=fleet.gateway_url, headers=HEADERS, timeout=30) as client:
        sent = 0

        @SETTINGS
        @given(body=bodies(spec, schema))
        def fuzz(body: bytes) -> None:
            nonlocal sent
            sent += 1
            check(client, path, body)

        fuzz()
        assert sent >= 2000
        assert STATUSES.get(200, 0) >= 50, STATUSES  # the generator reaches the engine, not only the checks
        assert httpx.get(fleet.gateway_url + "/healthz").status_code == 200
        ok = client.post("/v1/completions", json={"model": "support-acme", "prompt": "after", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def test_the_openapi_description_names_the_tenant_endpoints(spec: dict[str, Any]) -> None:
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])
    assert spec["openapi"].startswith("3.")
