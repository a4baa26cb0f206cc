"""vLLM protocol conformance: every test runs against the simulator and against a real vLLM (CPU) server.

The simulator must pass everything vLLM passes. Where the two differ on purpose, the test says so: the text
(a random tiny model versus the simulator's word generator) and timings are never compared across them.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.completion_create_params import CompletionCreateParamsBase as CompletionParams

from backends.vllm import parse_load_signals
from tests.servers import EngineProcess

pytestmark = pytest.mark.timeout(400)  # the first test waits for vLLM to start (about 40 s here, more on a busy box)


@pytest.fixture
def client(engine: EngineProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", timeout=60, max_retries=0) as sdk:
        yield sdk


@pytest.fixture
def http(engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=60) as raw:
        yield raw


def _assert_error_body(response: httpx.Response, status: int, message_pattern: str = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["code"] == status
    assert re.search(message_pattern, error["message"]), error["message"]


# --- models ---------------------------------------------------------------------------------------------------
def test_models_lists_base_and_loaded_adapters(engine: EngineProcess, client: openai.OpenAI) -> None:
    cards = {card.id: card.model_dump() for card in client.models.list().data}
    assert cards[engine.base_model]["parent"] is None
    for name in ("a1", "a2"):
        assert cards[name]["parent"] == engine.base_model
        assert cards[name]["root"] == engine.adapters[name]
        assert cards[name]["owned_by"] == "vllm"


# --- completions ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["a1", "tiny-llama", ""], ids=["adapter", "base", "empty-model-is-base"])
def test_completion_non_streaming(client: openai.OpenAI, model: str) -> None:
    completion = client.completions.create(model=model, prompt="hello world", max_tokens=5, temperature=0)
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    choice = completion.choices[0]
    assert isinstance(choice.text, str)
    assert choice.finish_reason in ("length", "stop")
    assert completion.usage is not None
    assert completion.usage.completion_tokens <= 5
    if choice.finish_reason == "length":
        assert completion.usage.completion_tokens == 5
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_completion_is_deterministic_and_adapters_differ(client: openai.OpenAI) -> None:
    def text(model: str) -> str:
        prompt = "the gateway routes each tenant to"
        return client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    assert text("a1") == text("a1")
    # Real vLLM: random LoRA weights change the greedy output; the simulator seeds its words with the adapter.
    assert len({text("a1"), text("a2"), text("tiny-llama")}) == 3


def test_completion_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    args: CompletionParams = {"model": "a1", "prompt": "hello world", "max_tokens": 6, "temperature": 0}
    whole = client.completions.create(**args)
    with_usage: CompletionParams = {**args, "stream_options": {"include_usage": True}}
    chunks = list(client.completions.create(**with_usage, stream=True))
    token_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in token_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in token_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None and whole.usage is not None
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens


def test_streaming_without_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model="a1", prompt="hello", max_tokens=3, stream=True))
    assert chunks and all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


def test_raw_stream_is_sse_ending_with_done(http: httpx.Client) -> None:
    body = {"model": "a1", "prompt": "hello", "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    assert len(events) == 3 + 1  # one chunk per token, then [DONE]


# --- chat -----------------------------------------------------------------------------------------------------
def test_chat_non_streaming(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model="a2", messages=[{"role": "user", "content": "hi there"}], max_tokens=4, temperature=0
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage is not None and chat.usage.completion_tokens <= 4


def test_chat_streaming(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="a2",
            messages=[{"role": "user", "content": "hi there"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(with_choices) - 1  # the role chunk carries no token


# --- errors ---------------------------------------------------------------------------------------------------
def test_unknown_model_is_404_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=2)
    assert "The model `no-such-adapter` does not exist." in str(caught.value)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        pytest.param(b"{bad json", 400, id="malformed-json"),
        pytest.param(b'{"model": "a1"}', 400, id="missing-prompt"),
        pytest.param(b'{"model": "a1", "prompt": "x", "max_tokens": "many"}', 400, id="max-tokens-wrong-type"),
        pytest.param(b'{"model": "a1", "prompt": "x", "max_tokens": 0}', 400, id="max-tokens-zero"),
        pytest.param(b'{"model": "a1", "prompt": "x", "max_tokens": 100000}', 400, id="max-tokens-over-context"),
    ],
)
def test_bad_completion_requests(http: httpx.Client, body: bytes, status: int) -> None:
    response = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    _assert_error_body(response, status)


def test_unknown_route_is_fastapi_404(http: httpx.Client) -> None:
    response = http.get("/model_info")  # routers probe this; vLLM has no such route
    assert response.status_code == 404
    assert response.json() == {"detail": "Not Found"}


# --- LoRA endpoints -------------------------------------------------------------------------------------------
def test_load_use_unload_lifecycle(engine: EngineProcess, http: httpx.Client) -> None:
    name = f"a3-{uuid.uuid4().hex[:6]}"
    load = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": engine.adapters["a3"]})
    assert load.status_code == 200
    assert load.text == f"Success: LoRA adapter '{name}' added successfully."
    try:
        listed = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
        assert listed[name]["parent"] == engine.base_model
        again = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": engine.adapters["a3"]})
        _assert_error_body(again, 400, "has already been loaded")
        used = http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
        assert used.status_code == 200
    finally:
        unload = http.post("/v1/unload_lora_adapter", json={"lora_name": name})
    assert unload.status_code == 200
    assert unload.text == f"Success: LoRA adapter '{name}' removed successfully."
    assert name not in {card["id"] for card in http.get("/v1/models").json()["data"]}
    gone = http.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2})
    _assert_error_body(gone, 404, f"The model `{name}` does not exist")
    _assert_error_body(http.post("/v1/unload_lora_adapter", json={"lora_name": name}), 404, "cannot be found")


def test_load_missing_path_is_404(http: httpx.Client, tmp_path: object) -> None:
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "ghost", "lora_path": "/nonexistent/ghost"})
    _assert_error_body(response, 404, "No adapter found for /nonexistent/ghost")


def test_load_rank_above_limit_fails_and_server_survives(engine: EngineProcess, http: httpx.Client) -> None:
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": engine.adapters["big-rank"]})
    _assert_error_body(response, 500, "greater than max_lora_rank")
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json={"model": "a1", "prompt": "hi", "max_tokens": 2}).status_code == 200


# --- prefix-cache isolation -----------------------------------------------------------------------------------
def test_cache_salt_separates_prefix_caches(engine: EngineProcess, http: httpx.Client) -> None:
    """The gateway salts a tenant's requests for a model other tenants call too (gateway/tenants/directory.py):
    the engine must key its prefix cache by the salt. The same prompt under another salt, or none, finds nothing
    cached; under the same salt it finds its prefix. Read from the engine's own counters: each request's prompt
    shows in prefix_cache_queries_total, and its cached tokens in prefix_cache_hits_total, on the same update."""
    prompt = uuid.uuid4().hex + " " + " ".join(f"salt{i}" for i in range(60))  # nothing any other test cached

    def counters() -> tuple[float, float]:
        by_name = {name: value for name, _, value in _samples(http.get("/metrics").text)}
        return by_name["vllm:prefix_cache_queries_total"], by_name["vllm:prefix_cache_hits_total"]

    def hits(salt: str | None) -> float:
        queries, before = counters()
        body: dict[str, object] = {"model": engine.base_model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        assert http.post("/v1/completions", json=body).status_code == 200
        deadline = time.monotonic() + 10
        while (now := counters())[0] == queries:  # the engine's stats for this request are not in yet
            assert time.monotonic() < deadline, "prefix_cache_queries_total did not move"
            time.sleep(0.05)
        return now[1] - before

    assert hits("tenant-a") == 0
    assert hits("tenant-b") == 0  # the same prompt, another tenant's salt: nothing of tenant-a's
    assert hits(None) == 0
    assert hits("tenant-a") > 0  # its own prefix
    assert hits(None) > 0


# --- health and metrics ---------------------------------------------------------------------------------------
def test_health(http: httpx.Client) -> None:
    response = http.get("/health")
    assert response.status_code == 200
    assert response.content == b""


_SAMPLE = re.compile(r"^(?P<name>[a-z_:]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
            samples.append((match["name"], labels, float(match["value"])))
    return samples


def test_metrics_names_and_semantics(engine: EngineProcess, http: httpx.Client) -> None:
    prompt = " ".join(f"word{i}" for i in range(40))
    for _ in range(2):  # the second request finds the first one's prompt blocks cached
        assert http.post("/v1/completions", json={"model": "a1", "prompt": prompt, "max_tokens": 2}).status_code == 200
    samples = _samples(http.get("/metrics").text)
    by_name = {name: (labels, value) for name, labels, value in samples}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:generation_tokens_total",  # outlier detection reads a stalled engine from it
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_to_first_token_seconds_sum",
    ):
        labels, _ = by_name[name]
        assert labels["model_name"] == engine.base_model, name
    assert by_name["vllm:num_requests_running"][1] == 0
    assert by_name["vllm:prefix_cache_hits_total"][1] > 0
    assert by_name["vllm:generation_tokens_total"][1] >= 4  # two requests of two tokens
    assert by_name["vllm:time_to_first_token_seconds_count"][1] >= 2
    info = [(labels, value) for name, labels, value in samples if name == "vllm:lora_requests_info"]
    assert info, "vllm:lora_requests_info is missing"
    assert all(labels["max_lora"] == "2" for labels, _ in info)
    assert any(labels["running_lora_adapters"] == "a1" for labels, _ in info)
    newest, _ = max(info, key=lambda item: item[1])  # the value is a timestamp: the newest series is current
    assert newest["running_lora_adapters"] == "" and newest["waiting_lora_adapters"] == ""
    # What the gateway's driver reads from the same page (predicted_ttft and the engine load view).
    load = parse_load_signals(http.get("/metrics").text)
    assert load is not None
    assert (load.running, load.waiting, load.running_adapters, load.gpu_slots) == (0, 0, frozenset(), 2)
    assert load.generated_tokens is not None and load.generated_tokens >= 4
