"""The parts of aiohttp's ``RequestHandler`` the tenant listener builds on, pinned to the source they were read from
(aiohttp 3.14.5). gateway/serving/connections.py's read rule (``fragmented``) counts every ``data_received`` call with
bytes as a socket read and relies on aiohttp calling it with ``b""`` only to resume a parse it paused
(``_resume_reading_if_drained``); gateway/serving/inline_requests.py is a copy of ``start`` with its per-request task
removed, aiohttp's loop line for line but for that. pyproject allows any 3.14 patch release, and a patch release may
change any of these (a new branch in ``start``, another caller of ``data_received``) while every behaviour test still
passes: this test fails on any change to their source, so that an upgrade is read against them first. When it fails:
read the new source against what builds on it, update those, then the digest here."""

from __future__ import annotations

import hashlib
import inspect

import aiohttp
import pytest
from aiohttp.web_protocol import RequestHandler

# sha256 of ``inspect.getsource`` of each method, as aiohttp 3.14.5 ships it.
PINNED = {
    "start": "2e565fd40c8e04fb3afb481d5ba52691a61d28396573b4b8a4cf3b168782288e",
    "_handle_request": "a88a34ee65a2714c6b392d23963ba9a80e7d50d4889905cd949a94d479102d8f",
    "data_received": "1ee57ebe052e6c80ced26c96e4ccb1223172e1d55afba460353c5e414914d3f6",
    "_resume_reading_if_drained": "27f2a6fbbb3a790e736723585047f5d7d09e66606f4f422675efec17de513dc2",
}
READ_FROM = "3.14.5"


def digest(name: str) -> str:
    return hashlib.sha256(inspect.getsource(getattr(RequestHandler, name)).encode()).hexdigest()


@pytest.mark.parametrize("name", sorted(PINNED))
def test_aiohttps_request_handler_is_the_source_the_gateway_was_read_against(name: str) -> None:
    assert digest(name) == PINNED[name], (
        f"aiohttp {aiohttp.__version__}'s RequestHandler.{name} is not the source of aiohttp {READ_FROM} that "
        "gateway/serving/ was written against: read the change against what builds on it (this module's docstring)"
    )


def test_a_changed_method_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pin reads the source that runs: a method replaced (as an upgrade would) no longer matches."""

    async def start(self: RequestHandler) -> None:  # aiohttp's loop with a line changed
        return None

    monkeypatch.setattr(RequestHandler, "start", start)
    assert digest("start") != PINNED["start"]
