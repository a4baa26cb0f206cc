"""End to end: the openai SDK -> `tenantgate serve` -> simulated vLLM replicas, all real processes on loopback."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat.completion_create_params import CompletionCreateParamsBase as ChatParams
from openai.types.completion_create_params import CompletionCreateParamsBase as CompletionParams

from loadtests.fleet import ADMIN_TOKEN, RunningFleet, api_key, fleet_with_gateway, sim_stats

pytestmark = pytest.mark.timeout(120)

TENANTS = {
    "acme": ["support-acme"],
    "globex": ["sql-globex"],
    "initech": ["chat-initech", "code-initech"],
    **{f"t{i}": [f"adapter-t{i}"] for i in range(9)},
}


KEY = {"Authorization": f"Bearer {api_key('acme')}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    """One fleet for the module's tests (starting one takes seconds). No test depends on what ran before it: each
    counts only what it caused (the simulators' counters before and after) or traffic of tenants no other test
    here sends (t0-t8 belong to the homes test alone), and the one that unloads an adapter behind the gateway's
    back ends with it loaded again. Each test passes alone, and the whole module passes in reverse order."""
    root = tmp_path_factory.mktemp("e2e")
    with fleet_with_gateway(root, TENANTS, 3, ["--time-scale", "0.01", "--max-loras", "4"], max_adapters=4) as fleet:
        yield fleet


def sdk(fleet: RunningFleet, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key(tenant), max_retries=0, timeout=30)


def home_of(fleet: RunningFleet, tenant: str, adapter: str | None = None) -> str:
    query = f"?tenant={tenant}" + (f"&adapter={adapter}" if adapter else "")
    decision = httpx.get(fleet.gateway_url + "/admin/route" + query, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert decision.status_code == 200, decision.text
    home: str = decision.json()["home"]
    return home


def requests_by_model(fleet: RunningFleet) -> dict[str, Counter[str]]:
    """Each replica's requests served per model, as the simulator counts them."""
    return {replica: Counter(sim_stats(url)["requests_by_model"]) for replica, url in fleet.replica_urls.items()}


def direct(fleet: RunningFleet, replica: str, path: str, body: Mapping[str, object]) -> dict[str, Any]:
    answer: dict[str, Any] = httpx.post(fleet.replica_urls[replica] + path, json=body, timeout=30).json()
    return answer


def test_completion_text_is_what_the_replica_answers_for_the_adapter(fleet: RunningFleet) -> None:
    args: CompletionParams = {"model": "support-acme", "prompt": "summarise my ticket", "max_tokens": 7}
    through_gateway = sdk(fleet, "acme").completions.create(**args)
    from_replica = direct(fleet, home_of(fleet, "acme"), "/v1/completions", args)
    assert through_gateway.choices[0].text == from_replica["choices"][0]["text"]
    assert through_gateway.usage is not None and through_gateway.usage.completion_tokens == 7


def test_streaming_completion_matches_the_whole_answer(fleet: RunningFleet) -> None:
    args: CompletionParams = {"model": "support-acme", "prompt": "stream me", "max_tokens": 9}
    ignore_eos = {"ignore_eos": True}
    whole = sdk(fleet, "acme").completions.create(**args, extra_body=ignore_eos)
    with_usage: CompletionParams = {**args, "stream_options": {"include_usage": True}}
    chunks = list(sdk(fleet, "acme").completions.create(**with_usage, stream=True, extra_body=ignore_eos))
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 9
    assert "".join(c.choices[0].text for c in token_chunks) == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9


def test_stream_reaches_the_client_before_the_engine_has_finished(fleet: RunningFleet) -> None:
    replica = fleet.replica_urls[home_of(fleet, "acme")]
    assert sdk(fleet, "acme").completions.create(model="support-acme", prompt="warm", max_tokens=1).choices
    body = {"model": "support-acme", "prompt": "x", "max_tokens": 50, "ignore_eos": True, "stream": True}
    # The engine makes one step and holds: the first token must come through while 49 are still to be generated.
    httpx.post(replica + "/sim/control", json={"run_steps": 1})
    try:
        with httpx.stream(
            "POST", fleet.gateway_url + "/v1/completions", json=body, headers=KEY, timeout=30
        ) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            assert sim_stats(replica)["running"] == 1
            httpx.post(replica + "/sim/control", json={"paused": False})
            rest = [line for line in lines if line]
    finally:
        httpx.post(replica + "/sim/control", json={"paused": False})
    assert rest[-1] == "data: [DONE]"
    assert len(rest) == 49 + 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streaming"])
def test_chat_completions(fleet: RunningFleet, stream: bool) -> None:
    args: ChatParams = {
        "model": "sql-globex",
        "messages": [{"role": "user", "content": "list tables"}],
        "max_tokens": 5,
    }
    client = sdk(fleet, "globex")
    answer: str | None
    if stream:
        chunks = list(client.chat.completions.create(**args, stream=True))
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        answer = client.chat.completions.create(**args).choices[0].message.content
    from_replica = direct(fleet, home_of(fleet, "globex"), "/v1/chat/completions", args)  # loaded there by now
    assert answer == from_replica["choices"][0]["message"]["content"]


def test_models_lists_only_the_tenants_own(fleet: RunningFleet) -> None:
    assert sorted(m.id for m in sdk(fleet, "initech").models.list().data) == [
        "chat-initech",
        "code-initech",
        "tiny-llama",
    ]


def test_unknown_key_is_401(fleet: RunningFleet) -> None:
    client = openai.OpenAI(base_url=fleet.gateway_url + "/v1", api_key="not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.completions.create(model="support-acme", prompt="x")
    assert caught.value.code == "invalid_api_key"


def test_another_tenants_adapter_is_404_like_a_missing_one(fleet: RunningFleet) -> None:
    client = sdk(fleet, "acme")
    errors = []
    for model in ("sql-globex", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model=model, prompt="x", max_tokens=2)
        errors.append(caught.value)
    assert [e.code for e in errors] == ["model_not_found", "model_not_found"]
    foreign, missing = (
        str(e.body).replace(model, "M") for e, model in zip(errors, ("sql-globex", "no-such-adapter"), strict=True)
    )
    assert foreign == missing  # the same answer, word for word: nothing tells the two apart


def test_absent_model_uses_the_tenants_first_adapter(fleet: RunningFleet) -> None:
    response = httpx.post(
        fleet.gateway_url + "/v1/completions",
        json={"prompt": "no model named", "max_tokens": 3},
        headers={"Authorization": f"Bearer {api_key('initech')}"},
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "chat-initech"


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        pytest.param("/v1/completions", b"{not json", 400, None, id="malformed-json"),
        pytest.param("/v1/completions", b"[1, 2]", 400, None, id="not-an-object"),
        pytest.param("/v1/completions", b'{"model": "support-acme"}', 400, "prompt", id="missing-prompt"),
        pytest.param("/v1/chat/completions", b'{"model": "support-acme"}', 400, "messages", id="missing-messages"),
        pytest.param("/v1/completions", b'{"prompt": "x", "max_tokens": "ten"}', 400, "max_tokens", id="wrong-type"),
        pytest.param("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400, "stream", id="stream-not-bool"),
        pytest.param("/v1/completions", b'{"prompt": "x", "model": 7}', 400, "model", id="model-not-string"),
        pytest.param("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "messages", id="no-role"),
        pytest.param("/v1/completions", b'{"prompt": "' + b"x" * 2_000_000 + b'"}', 413, None, id="oversize"),
        pytest.param("/v1/completions", b'{"prompt": "x", "max_tokens": 999999}', 400, None, id="engine-refuses"),
        # no tenant can make an engine load a path: the field is refused before anything is sent
        pytest.param("/v1/completions", b'{"prompt": "x", "lora_path": "/etc"}', 400, "lora_path", id="unknown-field"),
        pytest.param(
            "/v1/completions",
            b'{"prompt": "x", "user": ' + b"[" * 40 + b"]" * 40 + b"}",
            400,
            None,
            id="nested-too-deep",
        ),
        pytest.param("/v1/completions", b'{"prompt": "' + b"x" * 300_000 + b'"}', 400, "prompt", id="prompt-too-long"),
        pytest.param(
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]}',
            400,
            "messages",
            id="bad-content-part",
        ),
    ],
)
def test_bad_requests_get_openai_errors_and_the_gateway_keeps_serving(
    fleet: RunningFleet, path: str, body: bytes, status: int, param: str | None
) -> None:
    response = httpx.post(fleet.gateway_url + path, content=body, headers=KEY)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert sdk(fleet, "globex").completions.create(model="sql-globex", prompt="still up?", max_tokens=2).choices


def test_each_tenant_lands_on_its_home_and_homes_spread(fleet: RunningFleet) -> None:
    tenants = [f"t{i}" for i in range(9)]
    before = requests_by_model(fleet)  # the start-up fill's warm-up requests included
    for _ in range(3):
        for tenant in tenants:
            sdk(fleet, tenant).completions.create(model=f"adapter-{tenant}", prompt="hello", max_tokens=2)
    served = {replica: +(models - before[replica]) for replica, models in requests_by_model(fleet).items()}
    homes = {tenant: home_of(fleet, tenant) for tenant in tenants}
    for tenant, home in homes.items():
        assert served[home].get(f"adapter-{tenant}") == 3, (tenant, served)
    for replica, models in served.items():  # and nothing of theirs anywhere else
        assert all(homes[m.removeprefix("adapter-")] == replica for m in models if m.startswith("adapter-t")), served
    # Homes spread: balanced homes (the default) give each of the 3 replicas ceil(12 tenants / 3) = 4 of them,
    # where the ring alone gives some replica more (its arcs are uneven), and t0-t8 are served by every replica.
    every_home = Counter(home_of(fleet, tenant) for tenant in TENANTS)
    assert every_home == dict.fromkeys(fleet.replica_urls, 4), every_home
    assert {replica for replica, models in served.items() if any(m.startswith("adapter-t") for m in models)} == set(
        fleet.replica_urls
    )


@pytest.fixture(scope="module")
def bounded_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    """The same fleet under bounded_consistent_hash, which spills at a known load: predicted_ttft (the default)
    keeps a burst home while waiting there is predicted faster than a cold load elsewhere, so it would not test
    the single flight on a cold replica. The capacity floor is 1 (the plain bound): a burst spills as soon as two of
    its requests overlap, where the default floor (8) needs eight in flight at once, which a fast simulated fleet
    does not always reach."""
    root = tmp_path_factory.mktemp("e2e-bounded")
    sim = ["--time-scale", "0.01", "--max-loras", "4"]
    routing = {"affinity": "tenant", "balance_factor": 1.25, "vnodes": 160, "capacity_floor": 1}
    with fleet_with_gateway(
        root, TENANTS, 3, sim, max_adapters=4, policy="bounded_consistent_hash", extra={"routing": routing}
    ) as fleet:
        yield fleet


def test_concurrent_first_requests_load_the_adapter_once(bounded_fleet: RunningFleet) -> None:
    fleet = bounded_fleet

    async def burst() -> None:
        client = openai.AsyncOpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key("initech"), max_retries=0)
        async with client:
            await asyncio.gather(
                *(client.completions.create(model="code-initech", prompt=f"p{i}", max_tokens=20) for i in range(12))
            )

    before = [sim_stats(url) for url in fleet.replica_urls.values()]
    asyncio.run(burst())
    stats = [sim_stats(url) for url in fleet.replica_urls.values()]
    # 12 at once exceed the home's bounded share (each lasts a few ms: they overlap), so some spill; each replica
    # that got any loaded it once at most (the home had it from the start-up's fill, unless the module's earlier
    # traffic pushed it out of host memory).
    served = [s["requests_by_model"].get("code-initech", 0) - b["requests_by_model"].get("code-initech", 0)
              for s, b in zip(stats, before, strict=True)]  # fmt: skip
    loads = [s["cold_loads_by_adapter"].get("code-initech", 0) - b["cold_loads_by_adapter"].get("code-initech", 0)
             for s, b in zip(stats, before, strict=True)]  # fmt: skip
    assert sum(served) == 12
    assert all(load <= (1 if n else 0) for load, n in zip(loads, served, strict=True)), (loads, served)
    assert sum(1 for n in served if n) > 1  # it did spill: the single flight was tested on a cold replica too


def test_probes_and_admin_auth(fleet: RunningFleet) -> None:
    assert httpx.get(fleet.gateway_url + "/healthz").status_code == 200
    assert httpx.get(fleet.gateway_url + "/readyz").json() == {"status": "ready", "residency_store": "up"}
    assert httpx.get(fleet.gateway_url + "/admin/route?tenant=acme").status_code == 401
    wrong = httpx.get(fleet.gateway_url + "/admin/route?tenant=acme", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert httpx.get(fleet.gateway_url + "/nowhere").json()["error"]["code"] == "not_found"


def test_hot_tenant_spills_and_the_others_stay_home(tmp_path: Path) -> None:
    """Seven tenants are active, then one turns hot with 10x their traffic: it spills off its home, every other
    tenant's requests all land on its home replica (home reservations), and every request is served.

    A reservation lapses ``home_reservation_s`` after its key's last request, so the quiet tenants' first requests of
    the hot phase keep theirs only if they come within that window of the warm-up's: on a busy machine the two
    phases, with 17 SDK clients made in between, could be more than the default's 2 s apart (a 2.5 s pause between
    them failed three runs of three), and a quiet tenant's first request spilled. So the clients are made before
    the warm-up, both phases run in one event loop, and the window is 10 s: the test is about what a reservation
    does, not how long the default keeps it."""
    tenants = {f"h{i}": [f"adapter-h{i}"] for i in range(8)}
    hot, others = "h0", [f"h{i}" for i in range(1, 8)]
    sim_args = ["--time-scale", "0.05", "--max-loras", "8", "--max-cpu-loras", "8"]
    routing = {"affinity": "tenant", "balance_factor": 1.25, "vnodes": 160, "home_reservation_s": 10.0}
    with fleet_with_gateway(
        tmp_path, tenants, 4, sim_args, max_adapters=8, policy="bounded_consistent_hash", extra={"routing": routing}
    ) as fleet:
        homes = {tenant: home_of(fleet, tenant) for tenant in tenants}

        def served() -> dict[str, dict[str, int]]:
            return {replica: sim_stats(url)["requests_by_model"] for replica, url in fleet.replica_urls.items()}

        async def run() -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
            clients = {
                t: openai.AsyncOpenAI(base_url=fleet.gateway_url + "/v1", api_key=api_key(t), max_retries=0)
                for t in tenants
            }

            async def worker(tenant: str, requests: int) -> None:
                for i in range(requests):
                    await clients[tenant].completions.create(
                        model=f"adapter-{tenant}", prompt=f"q{i}", max_tokens=8, extra_body={"ignore_eos": True}
                    )

            await asyncio.gather(*(worker(t, 1) for t in others))  # the others are active
            before = served()
            await asyncio.gather(*(worker(hot, 12) for _ in range(10)), *(worker(t, 12) for t in others))
            after = served()
            for client in clients.values():
                await client.close()
            return before, after

        before, after = asyncio.run(run())

    def at_home(tenant: str) -> int:
        home, model = homes[tenant], f"adapter-{tenant}"
        return after[home].get(model, 0) - before[home].get(model, 0)

    assert at_home(hot) < 120  # it spilled
    assert sum(after[r].get(f"adapter-{hot}", 0) - before[r].get(f"adapter-{hot}", 0) for r in after) == 120
    assert {t: at_home(t) for t in others} == dict.fromkeys(others, 12)  # every one of theirs at home


def test_adapter_the_engine_lost_is_loaded_again(fleet: RunningFleet) -> None:
    client = sdk(fleet, "acme")
    client.completions.create(model="support-acme", prompt="before", max_tokens=2)
    replica = fleet.replica_urls[home_of(fleet, "acme")]
    served_before = sim_stats(replica)["requests_by_model"]["support-acme"]
    # Someone unloads it behind the gateway's back (an operator, or an engine restart).
    assert httpx.post(replica + "/v1/unload_lora_adapter", json={"lora_name": "support-acme"}).status_code == 200
    assert "support-acme" not in sim_stats(replica)["registered"]
    assert client.completions.create(model="support-acme", prompt="after", max_tokens=2).choices
    after = sim_stats(replica)
    assert "support-acme" in after["registered"]  # the gateway loaded it again on the same replica
    assert after["requests_by_model"]["support-acme"] == served_before + 1
