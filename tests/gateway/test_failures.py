"""What each engine failure means: retry elsewhere?, counts against the replica?, what the client sees
(gateway/failures.py, the one table dispatch and the admin API read)."""

from __future__ import annotations

import pytest

from backends.errors import (
    AdapterCacheFull,
    AdapterLoadFailed,
    AdapterNotLoaded,
    BackendError,
    DeadlineExceeded,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    StreamBroken,
)
from gateway.failures import ENGINE_MESSAGE_CHARS, classify


@pytest.mark.parametrize(
    ("error", "retryable", "blame", "status"),
    [
        pytest.param(EngineUnavailable("refused"), True, "replica", 502, id="unreachable"),
        # A timeout may be a long generation or a stalled engine: counted only on evidence (outlier.py).
        pytest.param(EngineTimeout("slow"), False, "suspect", 504, id="timeout"),
        pytest.param(DeadlineExceeded("the request's own deadline"), False, "none", 504, id="own-deadline"),
        pytest.param(StreamBroken("cut"), True, "replica", 502, id="stream-cut"),
        # A 5xx may be the request's doing (a prompt that makes the engine fail): tried elsewhere, which tells.
        pytest.param(EngineRejected(500, "crashed"), True, "suspect", 502, id="engine-500"),
        pytest.param(EngineRejected(503, "overloaded"), True, "suspect", 502, id="engine-503"),
        # The engine names it the client's: never counts, whatever the status; not retried.
        pytest.param(EngineRejected(500, "bad input", "BadRequestError"), False, "none", 400, id="engine-500-client"),
        pytest.param(EngineRejected(400, "prompt too long"), False, "none", 400, id="engine-400"),
        pytest.param(EngineRejected(404, "no such model"), False, "none", 502, id="engine-404"),
        # Busy (an engine, or a proxy before it, limiting): the request was fine, so not the client's 400; another
        # replica may take it, and none blames this one.
        pytest.param(EngineRejected(429, "slow down"), True, "none", 503, id="engine-429"),
        pytest.param(EngineRejected(429, "slow down", "BadRequestError"), True, "none", 503, id="engine-429-typed"),
        # A full PEFT cache is load from other adapters, not a broken replica: no ejection, but try elsewhere.
        pytest.param(AdapterCacheFull(503, "Cache is full"), True, "none", 503, id="cache-full"),
        # Gone again after the gateway loaded it once more (another gateway took its slot): contention, as above.
        pytest.param(AdapterNotLoaded(404, "unknown adapter"), True, "none", 503, id="adapter-gone-twice"),
        pytest.param(AdapterLoadFailed("a1", 400, "bad weights"), False, "none", 502, id="load-failed"),
        pytest.param(BackendError("anything else"), False, "none", 502, id="other"),
    ],
)
def test_what_each_failure_means(error: BackendError, retryable: bool, blame: str, status: int) -> None:
    verdict = classify(error)
    assert (verdict.retryable, verdict.blame, verdict.error.status) == (retryable, blame, status)


def test_an_engine_400_passes_its_own_message_to_the_client() -> None:
    assert classify(EngineRejected(400, "max_tokens is over the context")).error.message == (
        "max_tokens is over the context"
    )


def test_a_tenants_own_deadline_does_not_count_against_the_replica() -> None:
    assert classify(EngineTimeout("the tenant's 2 s"), tenant_deadline=True).blame == "none"
    assert classify(EngineTimeout("the pool's timeout"), tenant_deadline=False).blame == "suspect"
    assert classify(StreamBroken("cut"), tenant_deadline=True).blame == "replica"


def test_an_engine_429_is_a_503_with_the_gateways_own_retry_after_not_a_400() -> None:
    """An engine (or a rate-limiting proxy before it) answering 429 was mapped with every 4xx to a 400 "invalid
    request" carrying the engine's text: a valid request told it was wrong, which no client retries. It is the
    replica's moment, not the request's fault: tried elsewhere, else a 503 with the gateway's own Retry-After (an
    engine's header is never passed through: what it says is unchecked)."""
    error = classify(EngineRejected(429, "Too many requests; Retry-After: banana")).error
    assert (error.status, error.headers) == (503, {"Retry-After": "1"})
    assert "banana" not in error.message and error.code == "upstream_busy"  # README says so
    assert ENGINE_MESSAGE_CHARS == 1000  # README: cut at 1,000 characters


@pytest.mark.parametrize("status", [400, 500])
def test_an_engines_error_text_reaches_the_client_bounded(status: int) -> None:
    """An engine's 4xx text (or a 5xx it names the client's) is passed to the client as the error's message: one of
    megabytes (an engine's or a proxy's page, or a hostile engine's) went whole into the answer and the log line.
    It is cut at ENGINE_MESSAGE_CHARS characters, said so."""
    long = "x" * 5_000_000
    message = classify(EngineRejected(status, long, "BadRequestError")).error.message
    assert len(message) <= ENGINE_MESSAGE_CHARS + 40 and message.startswith("x" * 100) and message.endswith("cut)")
    assert classify(EngineRejected(400, "short")).error.message == "short"
