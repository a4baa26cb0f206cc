"""Observability: exact metric values after known traffic, bounded label sets, the span tree of a streaming
request with traceparent reaching the engine, the JSON access log, and the dashboard and alerts against the
metrics that exist."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from aiohttp.test_utils import TestServer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.observe.logs import json_formatter
from loadtests.fleet import ADMIN_TOKEN, RunningFleet, api_key, fleet_with_gateway, gateway_config, sim_stats
from tests.servers import EngineProcess

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[3]
TENANTS = {"acme": ["support-acme"], "globex": ["sql-globex"]}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(gateway_url: str) -> Samples:
    text = httpx.get(gateway_url + "/metrics", headers=ADMIN, timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over the series whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def series(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(ls) for (n, ls) in samples if n == name]


def home_of(fleet: RunningFleet, tenant: str) -> str:
    home: str = httpx.get(f"{fleet.gateway_url}/admin/route?tenant={tenant}", headers=ADMIN).json()["home"]
    return home


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    extra = {"telemetry": {"engine_scrape_interval_s": 0.2}}
    sim = ["--time-scale", "0.01", "--max-loras", "4"]
    # bounded_consistent_hash: the spill test needs a policy that spills at a known load (predicted_ttft keeps a
    # request home while waiting there is predicted faster than a cold load elsewhere).
    with fleet_with_gateway(
        tmp_path_factory.mktemp("telemetry"),
        TENANTS,
        3,
        sim,
        max_adapters=4,
        extra=extra,
        policy="bounded_consistent_hash",
    ) as f:
        yield f


def test_counters_after_known_traffic(fleet: RunningFleet) -> None:
    acme = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key("acme"), max_retries=0)
    for i in range(3):
        acme.completions.create(model="support-acme", prompt=f"q{i}", max_tokens=5, extra_body={"ignore_eos": True})
    globex = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key("globex"), max_retries=0)
    for _ in range(2):
        chunks = globex.chat.completions.create(
            model="sql-globex", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        list(chunks)
    httpx.post(fleet.gateway_url + "/v1/completions", headers={"Authorization": "Bearer wrong"}, json={})

    # A stream is counted on its handler's way out, after its last chunk has left: the scrape may come first.
    deadline = time.monotonic() + 10
    while (m := scrape(fleet.gateway_url)) and value(m, "tenantgate_requests_total", tenant="globex") < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    home = home_of(fleet, "acme")
    assert value(m, "tenantgate_requests_total", tenant="acme", adapter="support-acme", replica=home, status="200") == 3
    assert value(m, "tenantgate_requests_total", tenant="globex", adapter="sql-globex", status="200") == 2
    assert value(m, "tenantgate_requests_total", tenant="-", adapter="-", status="401") == 1
    # One load each, before any request: the start-up filled each home's free slots; then only hits.
    assert value(m, "tenantgate_adapter_loads_total", adapter="support-acme") == 1
    assert value(m, "tenantgate_adapter_loads_total", adapter="sql-globex") == 1
    assert value(m, "tenantgate_adapter_fill_loads_total") == 2
    assert value(m, "tenantgate_residency_lookups_total", result="miss") == 0
    assert value(m, "tenantgate_residency_lookups_total", result="hit") == 5
    assert value(m, "tenantgate_routing_decisions_total", tenant="acme", reason="home") == 3
    # Streams only: acme's answers were whole, so their time is the duration's alone.
    assert value(m, "tenantgate_time_to_first_token_seconds_count", tenant="acme") == 0
    assert value(m, "tenantgate_request_duration_seconds_count", tenant="acme") == 3
    assert value(m, "tenantgate_time_to_first_token_seconds_count", tenant="globex") == 2
    assert value(m, "tenantgate_request_duration_seconds_count", tenant="globex") == 2
    assert value(m, "tenantgate_completion_tokens_total", tenant="acme") == 15
    assert value(m, "tenantgate_completion_tokens_total", tenant="globex") == 8
    assert value(m, "tenantgate_prompt_tokens_total", tenant="acme") > 0
    assert value(m, "tenantgate_adapter_load_duration_seconds_count") == 2


def test_spills_are_counted_per_tenant_and_match_where_requests_ran(fleet: RunningFleet) -> None:
    """Hold every replica's step loop so requests pile up in flight, send a burst, then let them run. 12 at once:
    the home takes 8 (the capacity floor), the rest spill."""
    before = scrape(fleet.gateway_url)
    for url in fleet.replica_urls.values():
        httpx.post(url + "/sim/control", json={"paused": True})
    served_before = {r: sim_stats(u)["requests_by_model"].get("sql-globex", 0) for r, u in fleet.replica_urls.items()}

    async def burst() -> None:
        client = openai.AsyncOpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key("globex"), max_retries=0)
        calls = [client.completions.create(model="sql-globex", prompt=f"b{i}", max_tokens=2) for i in range(12)]
        pending = asyncio.gather(*calls)
        async with httpx.AsyncClient() as http:

            async def queued() -> int:
                stats = [(await http.get(u + "/sim/stats")).json() for u in fleet.replica_urls.values()]
                return sum(s["waiting"] + s["running"] for s in stats)

            for _ in range(200):  # bounded: until all twelve wait in the engines
                if await queued() >= 12:
                    break
                await asyncio.sleep(0.02)
            for url in fleet.replica_urls.values():
                await http.post(url + "/sim/control", json={"paused": False})
        await pending

    asyncio.run(burst())
    after = scrape(fleet.gateway_url)
    home = home_of(fleet, "globex")
    served = {
        r: sim_stats(u)["requests_by_model"].get("sql-globex", 0) - served_before[r]
        for r, u in fleet.replica_urls.items()
    }
    spilled = sum(count for replica, count in served.items() if replica != home)
    counted = value(after, "tenantgate_routing_decisions_total", tenant="globex", reason="spill:over_capacity") - value(
        before, "tenantgate_routing_decisions_total", tenant="globex", reason="spill:over_capacity"
    )
    assert spilled > 0 and counted == spilled


def test_upstream_errors_are_counted_by_kind(fleet: RunningFleet) -> None:
    client = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key("acme"), max_retries=0)
    before = value(scrape(fleet.gateway_url), "tenantgate_upstream_errors_total", kind="EngineRejected")
    with pytest.raises(openai.BadRequestError):  # the engine refuses: more tokens than its context
        client.completions.create(model="support-acme", prompt="x", max_tokens=100_000)
    after = scrape(fleet.gateway_url)
    assert value(after, "tenantgate_upstream_errors_total", kind="EngineRejected", replica=home_of(fleet, "acme")) == (
        before + 1
    )
    assert value(after, "tenantgate_requests_total", tenant="acme", status="400") == 1


def test_label_sets_stay_bounded_whatever_clients_send(fleet: RunningFleet) -> None:
    client = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key("acme"), max_retries=0)
    for _ in range(30):
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=f"random-{uuid.uuid4().hex}", prompt="x", max_tokens=1)
    m = scrape(fleet.gateway_url)
    not_found = [labels for labels in series(m, "tenantgate_requests_total") if labels["status"] == "404"]
    assert not_found == [{"tenant": "acme", "adapter": "-", "pool": "-", "replica": "-", "status": "404"}]
    assert all("random-" not in json.dumps(labels) for (_, labels) in m)


def test_engine_load_signals_are_scraped_and_explained(fleet: RunningFleet) -> None:
    for _ in range(1500):  # bounded (about 30 s): the scrape loop runs every 0.2 s
        m = scrape(fleet.gateway_url)
        if len(series(m, "tenantgate_engine_kv_cache_usage_ratio")) == 3:
            break
        time.sleep(0.02)
    assert len(series(m, "tenantgate_engine_waiting_requests")) == 3
    explained = httpx.get(f"{fleet.gateway_url}/admin/route?tenant=acme", headers=ADMIN).json()
    assert set(explained["engine_load"]) == set(fleet.replica_urls)
    assert {"loads", "reserved", "capacity", "resident", "reasons"} <= set(explained)
    assert explained["resident"] == [home_of(fleet, "acme")]  # support-acme was loaded there


def exported_families(gateway_url: str) -> dict[str, str]:
    """Every metric family the gateway exports, sampled yet or not (each has its TYPE line), by the name a query
    uses: a counter's samples are ``<name>_total``, a histogram's ``<name>_bucket`` (given as ``<name>``)."""
    text = httpx.get(gateway_url + "/metrics", headers=ADMIN, timeout=10).text
    families = {}
    for line in text.splitlines():
        if line.startswith("# TYPE tenantgate_"):
            _, _, name, kind = line.split()
            if name.endswith("_created"):  # prometheus_client's own creation timestamps, not a family of ours
                continue
            counter = kind == "counter" and not name.endswith("_total")
            families[name + "_total" if counter else name] = kind
    return families


def test_dashboard_and_alerts_use_only_metrics_that_exist(fleet: RunningFleet) -> None:
    exported = exported_families(fleet.gateway_url)
    dashboard = json.loads((REPO / "deploy/observability/grafana-dashboard.json").read_text())
    alerts = yaml.safe_load((REPO / "deploy/observability/alerts.yaml").read_text())
    expressions = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    expressions += [rule["expr"] for group in alerts["groups"] for rule in group["rules"]]
    used = {name for expr in expressions for name in re.findall(r"tenantgate_[a-z_]+", expr)}
    # A histogram is queried through its series: <name>_bucket, _sum, _count.
    used = {re.sub(r"_(bucket|sum|count)$", "", name) if name not in exported else name for name in used}
    assert used and used <= set(exported), used - set(exported)
    assert all(rule["alert"] and rule["labels"]["severity"] for g in alerts["groups"] for rule in g["rules"])


def test_every_exported_metric_is_documented(fleet: RunningFleet) -> None:
    """An operator finds each family the gateway exports in the README or docs/ (by the name a query uses)."""
    documented = (REPO / "README.md").read_text() + "".join(
        path.read_text() for path in sorted((REPO / "docs").glob("*.md"))
    )
    exported = exported_families(fleet.gateway_url)
    assert len(exported) >= 20  # the declared families appear before any traffic: the check is not vacuous
    missing = sorted(name for name in exported if name not in documented)
    assert not missing, f"exported but documented nowhere: {missing}"


async def test_span_tree_of_a_streaming_request_and_traceparent_reaches_the_engine(
    sim_engine: EngineProcess, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = GatewayConfig.model_validate(
        gateway_config({"r0": sim_engine.url}, {"acme": ["a3"]}, {"a3": sim_engine.adapters["a3"]}, port=0)
    )
    exporter = InMemorySpanExporter()
    app = create_app(config, span_exporter=exporter)
    trace_id, parent_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    caplog.set_level(logging.INFO, logger="tenantgate.access")
    async with TestServer(app, host="127.0.0.1") as server:
        client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key=api_key("acme"), max_retries=0)
        stream = await client.chat.completions.create(
            model="a3", messages=[{"role": "user", "content": "my secret prompt"}], max_tokens=3, stream=True,
            extra_headers={"traceparent": f"00-{trace_id}-{parent_span}-01"},
        )  # fmt: skip
        async for _ in stream:
            pass
        await client.close()
    spans = {span.name: span for span in exporter.get_finished_spans()}

    assert set(spans) == {"tenantgate.request", "admission", "route", "adapter.load", "upstream"}
    root = spans["tenantgate.request"]
    assert all(format(s.context.trace_id, "032x") == trace_id for s in spans.values())
    assert root.parent is not None and format(root.parent.span_id, "016x") == parent_span
    for child in ("admission", "route", "adapter.load", "upstream"):
        parent = spans[child].parent
        assert parent is not None and parent.span_id == root.context.span_id, child
    assert spans["route"].attributes is not None and spans["route"].attributes["tenantgate.route.reasons"] == ("home",)
    assert [event.name for event in spans["upstream"].events] == ["first_byte"]
    assert root.attributes is not None and root.attributes["http.response.status_code"] == 200
    upstream_id = format(spans["upstream"].context.span_id, "016x")
    assert f"00-{trace_id}-{upstream_id}-01" in sim_stats(sim_engine.url)["traceparents"]

    # The line as the gateway writes it (gateway/observe/logs.py's formatter).
    [line] = [json.loads(json_formatter().format(r)) for r in caplog.records if r.name == "tenantgate.access"]
    assert line["message"] == "request" and line["logger"] == "tenantgate.access"
    documented = "event path tenant adapter pool replica reasons status stream ttft_ms duration_ms prompt_tokens"
    documented += " completion_tokens error error_detail retries trace_id"  # README, Observability: Access log
    assert set(documented.split()) <= set(line), set(documented.split()) - set(line)
    assert line["tenant"] == "acme" and line["adapter"] == "a3" and line["replica"] == "r0"
    assert line["status"] == 200 and line["stream"] is True and line["reasons"] == ["home"]
    assert line["trace_id"] == trace_id and line["ttft_ms"] > 0 and line["duration_ms"] >= line["ttft_ms"]
    assert "secret" not in json.dumps(line) and api_key("acme") not in json.dumps(line)
